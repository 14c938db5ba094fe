"""The model section's partial exchange and adapter: what is accepted, and what is refused in one line."""

from __future__ import annotations

import pytest

from flasync.cli import main
from flasync.config import validate
from flasync.core.errors import ConfigError


def test_exchange_takes_patterns_or_trainable_and_adapter_implies_partial() -> None:
    """Patterns and 'trainable' validate; an adapter alone makes the model partial; the default is whole."""
    assert validate({"model": {"exchange": ["layers.2", "lora_*"]}}).model.exchange == ("layers.2", "lora_*")
    assert validate({"model": {"exchange": "trainable"}}).model.partial
    assert validate({"model": {"adapter": {"target": ["layers.0"]}}}).model.partial
    assert not validate({}).model.partial


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"model": {"exchange": []}}, "model.exchange: needs at least one non-empty name pattern"),
        ({"model": {"exchange": "everything"}}, "model.exchange: must be a list of name patterns or 'trainable'"),
        ({"model": {"adapter": {"target": []}}}, "model.adapter.target"),
        ({"model": {"adapter": {"target": ["layers.0"], "r": 0}}}, "model.adapter.r"),
        (
            {"model": {"exchange": ["layers.2"]}, "executor": {"kind": "vectorized"}},
            "executor.kind: 'vectorized' trains whole models; model.exchange needs 'thread', 'ray' or 'auto'",
        ),
        (
            {"model": {"adapter": {"target": ["layers.0"]}}, "executor": {"kind": "vectorized"}},
            "executor.kind: 'vectorized' trains whole models; model.adapter needs",
        ),
    ],
)
def test_bad_partial_models_are_refused(data: dict[str, object], expected: str) -> None:
    """Empty or unknown exchanges, bad adapters and the vectorized executor are refused, naming the field."""
    with pytest.raises(ConfigError) as info:
        validate(data)
    assert expected in str(info.value)


def test_a_pattern_that_selects_nothing_exits_2_in_one_line(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """`flasync run` with a pattern naming no parameter stops before training: one line, exit 2."""
    status = main(["run", "--set", 'model.exchange=["head"]', "--set", "stop.max_versions=2", "--tracking-uri", store])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if " run.phase " not in line]
    assert status == 2 and len(lines) == 1, err
    assert "model.exchange: pattern 'head' selects no parameter of the model (layers.0.weight" in lines[0]
