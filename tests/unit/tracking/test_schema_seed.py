"""Seeds: a new SQLite store replayed from the empty schema flasync ships is the store MLflow's migrations build."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import mlflow
import pytest

from flasync.tracking._schema_seed import SEEDS, schema_key, seed_file, write_seed
from flasync.tracking.store import prepare_sqlite_store


def _shape(db: Path) -> dict[str, Any]:
    """What MLflow relies on in a store: every table's columns, indexes and foreign keys, and the schema's rows
    (its version, the default workspace), not the text the DDL happened to be written in."""
    with contextlib.closing(sqlite3.connect(db)) as connection:
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        shape: dict[str, Any] = {}
        for table in sorted(tables):
            indexes = connection.execute(f'PRAGMA index_list("{table}")').fetchall()
            shape[table] = {
                "columns": connection.execute(f'PRAGMA table_info("{table}")').fetchall(),
                "foreign_keys": connection.execute(f'PRAGMA foreign_key_list("{table}")').fetchall(),
                "indexes": sorted(
                    (row[1], row[2], tuple(connection.execute(f'PRAGMA index_info("{row[1]}")').fetchall()))
                    for row in indexes
                ),
            }
        shape["rows"] = {
            table: sorted(connection.execute(f'SELECT * FROM "{table}"').fetchall())
            for table in ("alembic_version", "workspaces")
            if table in tables
        }
    return shape


def _migrations(self: object, *args: object, **kwargs: object) -> None:
    raise AssertionError("MLflow's migrations ran")


@pytest.mark.slow
def test_a_store_replayed_from_a_seed_is_the_store_the_migrations_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No migration runs for a seeded store; its tables, indexes, foreign keys and schema rows equal a migrated
    store's, it has no Default experiment until MLflow opens it, and MLflow then uses it as its own."""
    seeds = tmp_path / "seeds"
    written = write_seed(seeds)
    assert written == seed_file(seeds) and written.name == f"mlflow-schema-{schema_key()}.sql"
    migrated = tmp_path / "migrated" / "mlflow.db"
    prepare_sqlite_store(f"sqlite:///{migrated}", schema_cache=False, seeds=False)
    seeded = tmp_path / "seeded" / "mlflow.db"
    with monkeypatch.context() as patch:
        patch.setattr(mlflow.MlflowClient, "search_experiments", _migrations)
        prepare_sqlite_store(f"sqlite:///{seeded}", schema_cache=False, seeds=seeds)
    with contextlib.closing(sqlite3.connect(seeded)) as connection:
        assert connection.execute("SELECT COUNT(*) FROM experiments").fetchone()[0] == 0
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert _shape(seeded) == _shape(migrated)
    monkeypatch.chdir(tmp_path)
    client = mlflow.MlflowClient(f"sqlite:///{seeded}")
    (default,) = client.search_experiments()
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    run_id = client.create_run(client.create_experiment("works")).info.run_id
    client.log_metric(run_id, "m", 1.0, step=3)
    client.set_terminated(run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "m")] == [(3, 1.0)]
    assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["not SQL", "truncated"])
def test_a_seed_that_does_not_replay_leaves_the_store_to_the_migrations(tmp_path: Path, damage: str) -> None:
    """A seed under the installed MLflow's key that is not SQL, or was cut short (a damaged install), is no store:
    the migrations build it whole, and no half-replayed file is left."""
    seeds = tmp_path / "seeds"
    whole = write_seed(seeds).read_text(encoding="utf-8")
    if damage == "not SQL":
        broken = 'CREATE TABLE "runs" (run_uuid VARCHAR(32));\nthis is not SQL;\n'
    else:  # whole statements, but not the last ones (the COMMIT among them): it replays, and rolls back to nothing
        broken = whole[: whole.rindex(";\n", 0, len(whole) // 2) + 2]
    seed_file(seeds).write_text(broken, encoding="utf-8")
    db = tmp_path / "store" / "mlflow.db"
    prepare_sqlite_store(f"sqlite:///{db}", schema_cache=False, seeds=seeds)
    assert [p.name for p in db.parent.iterdir() if "building" in p.name] == []
    migrated = tmp_path / "migrated.db"
    prepare_sqlite_store(f"sqlite:///{migrated}", schema_cache=False, seeds=False)
    assert _shape(db) == _shape(migrated)
    assert mlflow.MlflowClient(f"sqlite:///{db}").create_experiment("works")


@pytest.mark.slow
def test_the_shipped_seed_is_the_schema_of_the_installed_mlflow(tmp_path: Path) -> None:
    """The seed flasync ships for this MLflow's migrations builds what they build; an MLflow with migrations of its
    own has no seed (its stores are migrated, as before), and the skip says how to write one."""
    shipped = seed_file(SEEDS)
    if not shipped.exists():
        pytest.skip(f"no seed ships for MLflow {mlflow.__version__}'s schema: python -m tracking._schema_seed")
    migrated, seeded = tmp_path / "migrated.db", tmp_path / "seeded.db"
    prepare_sqlite_store(f"sqlite:///{migrated}", schema_cache=False, seeds=False)
    prepare_sqlite_store(f"sqlite:///{seeded}", schema_cache=False)  # the shipped seeds are the default
    assert _shape(seeded) == _shape(migrated)
