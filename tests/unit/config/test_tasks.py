"""``task``: what each task refuses, in one line and exit 2 from the CLI, before training."""

from __future__ import annotations

from pathlib import Path

import pytest

from flasync.cli import main
from flasync.config import RunConfig, load_config
from flasync.core.errors import ConfigError

_EXAMPLE = Path(__file__).parents[3] / "examples" / "regression.toml"
_REGRESSION = ["task=regression", "data.kind=diabetes", "partition.kind=iid"]

_LANGUAGE_MODEL = [
    "task=language_model",
    "data.kind=files",
    "data.train=t.txt",
    "partition.kind=line_blocks",
    "model.kind=gru",
    "model.hidden=64",
]

REFUSED = [
    (["data.kind=diabetes"], "data.kind: 'diabetes' has real targets; it needs task = 'regression'"),
    (["task=regression", "partition.kind=iid"], "task: 'regression' needs float32 targets in the training and test"),
    (["task=regression", "data.kind=diabetes"], "partition.kind: 'dirichlet' splits by class label"),
    ([*_REGRESSION, "eval.metrics=[accuracy]"], "eval.metrics: 'accuracy' needs class labels"),
    ([*_REGRESSION, "eval.metrics=[loss, f1]"], "eval.metrics: 'f1' needs class labels"),
    ([*_REGRESSION, "eval.select=server/eval/accuracy:max"], "eval.select: 'server/eval/accuracy:max' needs class"),
    ([*_REGRESSION, "stop.target_accuracy=0.9"], "stop.target_accuracy: task = 'regression' has no accuracy"),
    ([*_REGRESSION, "executor.kind=vectorized"], "executor.kind: 'vectorized' trains classifiers only"),
    (["task=language_model"], "data.kind: task = 'language_model' needs data.kind = 'files' with a .txt train file"),
    (
        ["task=language_model", "data.kind=files", "data.train=t.txt", "partition.kind=line_blocks"],
        "model.kind: task = 'language_model' needs 'gru', not 'mlp'",
    ),
    (
        [*_LANGUAGE_MODEL, "executor.kind=vectorized"],
        "executor.kind: 'vectorized' cannot batch a GRU's clients",
    ),
    (
        ["data.kind=files", "data.train=t.txt"],
        "data.train: a .txt file makes next-character samples; it needs task = 'language_model'",
    ),
    (["partition.kind=line_blocks"], "partition.kind: 'line_blocks' cuts a .txt file"),
    (["model.kind=gru", "model.hidden=64"], "model.kind: 'gru' reads characters; it needs task = 'language_model'"),
    (["task=ranking"], "task: Input should be 'classification', 'regression' or 'language_model'"),
]


def test_another_model_kind_on_a_language_model_s_table_names_the_task_first() -> None:
    """``--set model.kind=mlp`` on the GRU example's table: the task's need, not the fields the MLP lacks."""
    example = _EXAMPLE.with_name("language_model.toml")
    for override in ("model.kind=mlp", 'model={kind = "cnn"}'):
        with pytest.raises(ConfigError) as error:
            load_config(example, [override])
        kind = "mlp" if "mlp" in override else "cnn"
        assert str(error.value) == f"model.kind: task = 'language_model' needs 'gru', not {kind!r}"


@pytest.mark.parametrize(
    ("sets", "expected"), REFUSED, ids=[r[1].split(":")[0] + str(i) for i, r in enumerate(REFUSED)]
)
def test_what_a_task_cannot_combine_with_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], sets: list[str], expected: str
) -> None:
    """``flasync run`` refuses each combination in one line, exit 2, before training (the data's targets when it
    loads them, the rest before)."""
    argv = ["run", str(_EXAMPLE), "--no-tracking"]
    for item in ["task=classification", "data.kind=digits", "partition.kind=dirichlet", *sets]:
        argv += ["--set", item]
    status = main(argv)
    # Apart from the progress lines saying which phase the run reached, one line: the error.
    err = [line for line in capsys.readouterr().err.strip().splitlines() if " run.phase " not in line]
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("flasync: error: ") and expected in err[0]


def test_the_regression_example_validates_and_selects_by_a_regression_metric() -> None:
    """The example is a valid regression config, and ``eval.select`` may take its metrics."""
    config = RunConfig.model_validate(
        {
            "task": "regression",
            "data": {"kind": "diabetes"},
            "partition": {"kind": "iid"},
            "eval": {"metrics": ["mae"], "select": "server/eval/mae:min"},
        }
    )
    assert config.task == "regression" and config.eval.select == "server/eval/mae:min"
    assert RunConfig().task == "classification"
