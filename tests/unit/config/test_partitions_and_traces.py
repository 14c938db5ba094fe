"""The partition kinds of non-IID skew and population.trace: loading, paths and one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from flasync.config import FeatureSkewPartition, LabelQuantityPartition, QuantityPartition, load_config
from flasync.core.errors import ConfigError


def _error(path: Path | None, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_skew_partitions_load_from_a_file(tmp_path: Path) -> None:
    """Each new kind loads with its parameters; quantity's law parameter is left unset until given."""
    path = tmp_path / "c.toml"
    path.write_text('[partition]\nkind = "label_quantity"\nlabels_per_client = 3\n')
    assert load_config(path).partition == LabelQuantityPartition(labels_per_client=3)
    quantity = load_config(None, ["partition.kind=quantity", "partition.distribution=powerlaw"]).partition
    assert quantity == QuantityPartition(distribution="powerlaw") and quantity.exponent is None
    feature = load_config(None, ["partition.kind=feature_skew", "partition.rotations=4"]).partition
    assert feature == FeatureSkewPartition(rotations=4)


def test_a_trace_path_is_read_from_the_config_files_folder(tmp_path: Path) -> None:
    """A relative population.trace in a config file is that file's folder's; one given by --set stays relative."""
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "c.toml").write_text('[population]\ntrace = "devices/t.csv"\n')
    assert load_config(tmp_path / "exp" / "c.toml").population.trace == str(tmp_path / "exp" / "devices" / "t.csv")
    assert load_config(tmp_path / "exp" / "c.toml", ["population.trace=u.json"]).population.trace == "u.json"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["partition.kind=label_quantity", "partition.labels_per_client=0"], "partition.labels_per_client: Input"),
        (["partition.kind=quantity", "partition.sigma=-1"], "partition.sigma: Input should be greater than or equal"),
        (["partition.kind=quantity", "partition.exponent=3"], "partition.exponent: is not used with distribution"),
        (["partition.kind=quantity", "partition.min_samples=0"], "partition.min_samples: Input should be greater"),
        (["partition.kind=feature_skew", "partition.rotations=0"], "partition.rotations: Input should be greater"),
        (["population.trace=t.parquet"], "population.trace: unsupported format of 't.parquet'"),
        (["population.trace=t.csv", "population.available_fraction=0.5"], "population.trace: gives the availability"),
        (
            ["population.trace=t.csv", "remote.enabled=true", "remote.tokens_file=x"],
            "population.trace: simulates devices",
        ),
    ],
)
def test_refusals_are_one_line_naming_the_field(overrides: list[str], expected: str) -> None:
    """Out-of-range parameters, a parameter of the other law, and what a trace cannot combine with."""
    assert expected in _error(None, overrides)
