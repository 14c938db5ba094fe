"""``flasync config explain``: what the schema says of each field, printed from the schema itself."""

from __future__ import annotations

import pytest

from flasync.cli import main
from flasync.config import RunConfig
from flasync.config.explain import explain, field_docs
from flasync.core.errors import ConfigError


@pytest.mark.slow
def test_every_field_is_explained_with_its_description_type_and_default() -> None:
    """Each value field of every section and choice has a description, and explaining its path prints it with its
    type and default (the text of the configuration reference)."""
    docs = field_docs()
    assert {doc.path for doc in docs if not doc.section} == set(RunConfig.model_fields)
    for doc in docs:
        if doc.table or (doc.path.endswith(".kind") and doc.kind is not None):
            continue
        assert doc.description, doc.path
        text = explain(doc.path)
        assert doc.description in text and f"type     {doc.type}" in text and f"default  {doc.default}" in text


def test_a_field_of_a_choice_names_its_kind_and_bounds() -> None:
    text = explain("server.buffer_size")
    assert text.startswith('server.buffer_size  (when server.kind = "fedbuff")')
    assert "type     int" in text and "default  10" in text and "bounds   >= 1" in text


def test_a_section_lists_its_fields_choice_by_choice() -> None:
    """A section (here a field holding a table with choices) prints the field, then each choice's fields."""
    text = explain("population.speed")
    for kind in ("constant", "lognormal", "halfnormal"):
        assert f'population.speed  (kind = "{kind}")' in text
    assert "population.speed.sigma" in text and "population.speed.seconds_per_step" in text


def test_an_unknown_path_names_the_closest_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"no field or section 'server\.bufer_size'; did you mean server\.buffer_size"
    ):
        explain("server.bufer_size")
    with pytest.raises(ConfigError, match=r"sections: .*server"):
        explain("zzz")


def test_the_command_prints_the_explanation_and_refuses_an_unknown_path_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "explain", "seed", "server.buffer_size"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("seed\n") and "server.buffer_size" in out and "every random stream" in out
    assert main(["config", "explain", "server.bufer_size"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "flasync: error: config explain: no field or section 'server.bufer_size'; did you mean "
        "server.buffer_size, server.optimizer?"
    ]
    assert main(["config"]) == 2
    assert "explain PATH" in capsys.readouterr().err
