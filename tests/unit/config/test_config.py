"""Run configuration: defaults, files, overrides and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from flasync.config import (
    ByColumnPartition,
    DigitsData,
    DirichletPartition,
    FedAsyncServer,
    FedBuffServer,
    FilesData,
    LogNormalSpeed,
    PolynomialStalenessConfig,
    RunConfig,
    apply_override,
    flatten,
    load_config,
)
from flasync.core.errors import ConfigError
from tests.conftest import EXAMPLES


def _error(path: str | Path | None = None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_are_the_showcase_experiment() -> None:
    """The default config is digits, 100 clients, Dirichlet(0.5), FedBuff K=10 C=20, poly a=0.5, virtual time."""
    cfg = RunConfig()
    assert isinstance(cfg.data, DigitsData)
    assert cfg.population.num_clients == 100
    assert cfg.partition == DirichletPartition(alpha=0.5)
    assert isinstance(cfg.server, FedBuffServer)
    assert (cfg.server.buffer_size, cfg.server.concurrency) == (10, 20)
    assert cfg.server.staleness == PolynomialStalenessConfig(a=0.5)
    assert isinstance(cfg.population.speed, LogNormalSpeed)
    assert cfg.clock == "virtual"


@pytest.mark.parametrize("name", ["fedbuff.toml", "fedasync.toml", "fedavg.yaml"])
def test_examples_load(name: str) -> None:
    """The three aggregators' examples name their server."""
    cfg = load_config(EXAMPLES / name)
    assert cfg.server.kind in name


@pytest.mark.parametrize("path", sorted([*EXAMPLES.glob("*.toml"), *EXAMPLES.glob("*.yaml")]), ids=lambda p: p.name)
def test_every_example_config_validates(path: Path) -> None:
    """Every config file in examples/ loads (a renamed field would break it)."""
    load_config(path)


def test_override_parses_types_and_nests() -> None:
    """--set values are parsed as YAML scalars and lists into nested tables."""
    cfg = load_config(None, ["server.buffer_size=7", "model.hidden=[32, 16]", "client.precision=bf16", "seed=3"])
    assert isinstance(cfg.server, FedBuffServer)
    assert cfg.server.buffer_size == 7
    assert cfg.model.kind == "mlp" and cfg.model.hidden == (32, 16)
    assert cfg.client.precision == "bf16"
    assert cfg.seed == 3


def test_override_switches_component_kind() -> None:
    """Setting server.kind picks another member of the discriminated union."""
    cfg = load_config(None, ["server.kind=fedasync", "server.alpha=0.3"])
    assert isinstance(cfg.server, FedAsyncServer)
    assert cfg.server.alpha == 0.3


def test_yaml_and_toml_files_agree(tmp_path: Path) -> None:
    """The same settings in TOML and YAML give the same config."""
    (tmp_path / "a.toml").write_text('seed = 5\n[server]\nkind = "fedasync"\nalpha = 0.5\n')
    (tmp_path / "a.yaml").write_text("seed: 5\nserver:\n  kind: fedasync\n  alpha: 0.5\n")
    assert load_config(tmp_path / "a.toml") == load_config(tmp_path / "a.yaml")


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is named."""
    assert "not found" in _error(tmp_path / "nope.toml")


def test_unparsable_toml(tmp_path: Path) -> None:
    """A TOML syntax error names the file."""
    path = tmp_path / "bad.toml"
    path.write_text("[server\nkind = 1\n")
    assert "invalid TOML" in _error(path)


def test_unparsable_yaml(tmp_path: Path) -> None:
    """A YAML syntax error names the file."""
    path = tmp_path / "bad.yaml"
    path.write_text("server: [unclosed\n")
    assert "invalid YAML" in _error(path)


def test_unsupported_extension(tmp_path: Path) -> None:
    """A file that is neither TOML nor YAML is refused."""
    path = tmp_path / "cfg.json"
    path.write_text("{}")
    assert "unsupported config format" in _error(path)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("server.bufer_size=3", "server.bufer_size: unknown field (did you mean buffer_size?)"),
        ("population.speed.sigm=1", "population.speed.sigm: unknown field (did you mean sigma?)"),
        ("codec.upload=[{kind: topk, ratoi: 0.1}]", "codec.upload.0.ratoi: unknown field (did you mean ratio?)"),
        (
            "server.zzz=1",
            "server.zzz: unknown field (fields: buffer_size, concurrency, example_weight, kind, max_staleness, "
            "optimizer, staleness)",
        ),
    ],
)
def test_unknown_key_names_the_field_and_the_closest_known_one(override: str, expected: str) -> None:
    """An unknown key is reported with its dotted path (discriminator tags stripped), then the closest field of its
    table, or that table's fields when none is close."""
    assert _error(None, [override]) == expected


def test_an_unknown_key_is_checked_against_the_fields_of_the_chosen_kind() -> None:
    """``concurrency`` is FedBuff's: under FedAvg it is unknown, and FedAvg's fields are the ones named."""
    assert _error(None, ["server.kind=fedavg", "server.concurrency=3"]) == (
        "server.concurrency: unknown field (fields: aggregation, clients_per_round, kind, min_clients, "
        "min_clients_wait_s, optimizer, trim_fraction)"
    )


def test_wrong_type_names_the_field() -> None:
    """A value of the wrong type is reported with the field and the value."""
    message = _error(None, ["population.num_clients=many"])
    assert message.startswith("population.num_clients:") and "'many'" in message


def test_out_of_range_names_the_field() -> None:
    """An out-of-range value is reported with the bound."""
    message = _error(None, ["server.buffer_size=0"])
    assert message.startswith("server.buffer_size:") and "greater than or equal to 1" in message


def test_nesterov_without_momentum_names_the_optimizer() -> None:
    """server.optimizer.nesterov needs momentum; the error names the field."""
    message = _error(None, ["server.optimizer.nesterov=true"])
    assert message == "server.optimizer.nesterov: needs momentum > 0"
    config = load_config(None, ["server.optimizer.nesterov=true", "server.optimizer.momentum=0.9"])
    assert config.server.optimizer.nesterov  # type: ignore[union-attr]


def test_unknown_kind_lists_choices() -> None:
    """An unknown component kind lists the valid ones."""
    message = _error(None, ["server.kind=fedprox"])
    assert message.startswith("server:") and "fedbuff" in message


def test_cross_field_error_names_the_field() -> None:
    """Concurrency above the population size is an error on server.concurrency."""
    message = _error(None, ["population.num_clients=5"])
    assert message.startswith("server.concurrency:") and "<= population.num_clients (5)" in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("server.buffer_size", "expected path.to.field=value"),
        ("=3", "expected path.to.field=value"),
        ("server..kind=x", "is not a dotted field path"),
        ("seed.inner=1", "seed: Input should be a valid integer"),
    ],
)
def test_malformed_set(override: str, expected: str) -> None:
    """A malformed --set is a one-line ConfigError."""
    assert expected in _error(None, [override])


def test_a_table_is_set_as_a_toml_inline_table_or_in_yaml() -> None:
    """A whole table in --set, written as the TOML config files write it or in YAML's flow style, gives the same
    config; TOML-looking text that is not TOML is read as before."""
    toml = load_config(None, ['model={kind = "mlp", hidden = [24, 12]}', 'server={kind = "fedasync", alpha = 0.4}'])
    flow = load_config(None, ["model={kind: mlp, hidden: [24, 12]}", "server={kind: fedasync, alpha: 0.4}"])
    assert toml == flow
    assert toml.model.kind == "mlp" and toml.model.hidden == (24, 12)
    assert isinstance(toml.server, FedAsyncServer) and toml.server.alpha == 0.4
    data: dict[str, object] = {}
    apply_override(data, "a={b = }")  # not TOML: YAML's reading, a key with no value
    assert data == {"a": {"b =": None}}


def test_apply_override_creates_tables() -> None:
    """apply_override creates intermediate tables."""
    data: dict[str, object] = {}
    apply_override(data, "a.b.c=1.5")
    assert data == {"a": {"b": {"c": 1.5}}}


def test_flatten_gives_dotted_params() -> None:
    """flatten produces dotted keys for MLflow params."""
    flat = flatten(RunConfig())
    assert flat["server.buffer_size"] == 10
    assert flat["server.staleness.kind"] == "polynomial"
    assert flat["population.speed.kind"] == "lognormal"


def test_diagnostics_and_slow_clients_settings() -> None:
    """Diagnostics levels and fixed client slowdowns are validated with one-line errors."""
    config = load_config(None, ["diagnostics.level=full", "population.slow_clients={3: 2.5}"])
    assert config.diagnostics.level == "full"
    assert config.population.slow_clients == {3: 2.5}
    with pytest.raises(ConfigError, match=r"diagnostics\.level"):
        load_config(None, ["diagnostics.level=loud"])
    with pytest.raises(ConfigError, match=r"population.slow_clients: client 100 is not in 0..99"):
        load_config(None, ["population.slow_clients={100: 2.0}"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config(None, ["population.slow_clients={1: 0}"])


# ------------------------------------------------------------------------------------------------ files data
_FILES = ["data.kind=files", "data.train=d.csv", "data.client_column=user"]


def test_files_data_and_by_column_partition_load_from_toml(tmp_path: Path) -> None:
    """A files source with a by_column partition loads; relative paths are read from the config's folder."""
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "c.toml").write_text(
        '[data]\nkind = "files"\ntrain = "data/train.csv"\ntest = "../test.npz"\nlabel = "label"\n'
        'client_column = "user"\nfeatures = "pixels"\n[partition]\nkind = "by_column"\nmin_samples = 3\n'
    )
    config = load_config(tmp_path / "exp" / "c.toml")
    assert config.data == FilesData(
        train=str(tmp_path / "exp" / "data" / "train.csv"),
        test=str(tmp_path / "test.npz"),
        label="label",
        client_column="user",
        features=("pixels",),
    )
    assert config.partition == ByColumnPartition(min_samples=3)
    assert "num_clients" not in config.population.model_fields_set  # by_column takes it from the data


def test_files_example_reads_its_data_beside_it() -> None:
    """examples/files_by_column.toml validates and names the file make_files_data.py writes, beside itself."""
    config = load_config(EXAMPLES / "files_by_column.toml")
    assert isinstance(config.data, FilesData) and isinstance(config.partition, ByColumnPartition)
    assert config.data.train == str(EXAMPLES / "data" / "digits_by_writer.csv")


def test_relative_data_paths_from_the_command_line_stay_relative(tmp_path: Path) -> None:
    """A path given by --set is the working directory's, even over a config file; absolute paths stay."""
    (tmp_path / "c.yaml").write_text("data:\n  kind: files\n  train: a.csv\n  test: /abs/t.csv\n")
    config = load_config(tmp_path / "c.yaml", ["data.train=b.csv"])
    assert isinstance(config.data, FilesData)
    assert (config.data.train, config.data.test) == ("b.csv", "/abs/t.csv")
    assert load_config(tmp_path / "c.yaml").data.train == str(tmp_path / "a.csv")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.kind=files"], "data.train: required field is missing"),
        (["data.kind=files", "data.train=d.json"], "data.train: unsupported format of 'd.json' (use .npz, .pt, .csv"),
        ([*_FILES, "data.test=t"], "data.test: unsupported format of 't'"),
        (["partition.kind=by_column"], "partition.kind: 'by_column' needs data.kind = 'files' with data.client_column"),
        (["data.kind=files", "data.train=d.csv", "partition.kind=by_column"], "needs data.kind = 'files' with"),
        ([*_FILES, "data.features=[a, b]", "data.train=d.npz"], "data.features: 'd.npz' holds its features in one"),
        ([*_FILES, "data.features=[a, label]", "data.label=label"], "data.features: 'label' is the label or client"),
        ([*_FILES, "data.features=[user]"], "data.features: 'user' is the label or client column"),
        ([*_FILES, "data.features=[]"], "data.features: must name at least one key or column"),
        ([*_FILES, "data.client_column=y"], "data.client_column: 'y' is already the label"),
        ([*_FILES, "data.test=t.csv", "data.test_fraction=0.3"], "data.test_fraction: is not used when data.test"),
        ([*_FILES, "data.num_classes=1"], "data.num_classes: Input should be greater than or equal to 2"),
        ([*_FILES, "data.path=d.csv"], "data.path: unknown field"),
        ([*_FILES, "partition.kind=by_column", "partition.min_samples=0"], "partition.min_samples: Input should be"),
    ],
)
def test_files_data_errors_name_the_field(overrides: list[str], expected: str) -> None:
    """Every wrong files/by_column setting is a one-line error naming the field."""
    assert expected in _error(None, overrides)


def test_files_data_is_flattened_into_params() -> None:
    """The files section and the by_column partition become dotted params."""
    flat = flatten(load_config(None, [*_FILES, "partition.kind=by_column", "data.features=[a, b]"]))
    assert flat["data.kind"] == "files" and flat["data.train"] == "d.csv" and flat["data.test"] is None
    assert flat["data.client_column"] == "user" and flat["data.features"] == ["a", "b"]
    assert flat["partition.kind"] == "by_column" and flat["partition.min_samples"] == 1


@pytest.mark.parametrize("select", ["server/eval/accuracy:max", "server/eval/loss:min", "server/eval/loss:max"])
def test_a_selection_names_an_evaluation_metric_and_a_direction(select: str) -> None:
    """eval.select takes each metric the central evaluation logs, with :max or :min."""
    assert load_config(None, [f"eval.select={select}"]).eval.select == select


def test_a_selection_may_name_a_metric_the_run_adds() -> None:
    """eval.select takes server/eval/NAME for a metric eval.metrics adds, built-in or a user's, and no other."""
    config = load_config(None, ["eval.metrics=[f1, brier=pkg.mod:Brier]", "eval.select=server/eval/brier:min"])
    assert config.eval.metric_names == ("accuracy", "loss", "f1", "brier")
    assert "'server/eval/f1' is not a metric this run logs" in _error(None, ["eval.select=server/eval/f1:max"])


def test_a_selection_may_name_a_client_side_figure_with_client_evaluation_on() -> None:
    """eval.select takes client_eval/<metric>/<figure> when eval.clients is on, and refuses it when it is off."""
    on = ["eval.clients.fraction=0.1", "eval.metrics=[f1]", "eval.select=client_eval/f1/worst10:max"]
    assert load_config(None, on).eval.select == "client_eval/f1/worst10:max"
    assert "is not a metric this run logs" in _error(None, on[1:])
    assert "is not a metric this run logs" in _error(None, [*on[:2], "eval.select=client_eval/f1/p75:max"])


@pytest.mark.parametrize(
    "name", ["digits", "My model v2", "fl-async_1.0", "", "  ", "a/b", "a:b", "100%", ".", "..", "a/../b"]
)
def test_registry_names_are_refused_where_mlflow_refuses_them(name: str) -> None:
    """tracking.register refuses what MLflow's registry refuses to name a model, and takes the rest."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.model_registry.file_store import _validate_model_name

    try:
        _validate_model_name(name)
        refused = False
    except MlflowException:
        refused = True
    if refused:
        assert _error(None, [f"tracking.register={name}"]).startswith("tracking.register: ")
    else:
        assert load_config(None, [f"tracking.register={name}"]).tracking.register == name


def test_run_name_may_name_seed_time_and_id_only() -> None:
    """tracking.run_name takes {seed}, {time} and {id}; another field or an unclosed brace is a one-line error."""
    assert load_config(None, ["tracking.run_name=a-{seed}-{time}-{id}"]).tracking.run_name == "a-{seed}-{time}-{id}"
    assert _error(None, ["tracking.run_name=a-{sed}"]).startswith("tracking.run_name: 'a-{sed}' names {sed}")
    assert _error(None, ["tracking.run_name=a-{seed"]).startswith("tracking.run_name: 'a-{seed': ")


def test_example_configs_name_repeated_runs_apart() -> None:
    """Every example config that names its runs puts the seed and the start time in the name."""
    named = [load_config(path, []).tracking.run_name for path in sorted(EXAMPLES.glob("*.toml"))]
    named += [load_config(EXAMPLES / "fedavg.yaml", []).tracking.run_name]
    given = [name for name in named if name is not None]
    assert given, "no example config names its runs"
    assert all("{seed}" in name and "{time}" in name for name in given), given
