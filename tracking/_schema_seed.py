"""Empty MLflow SQLite schemas shipped with flasync, so a machine's first store skips MLflow's migrations.

MLflow builds a new SQLite store's schema by running its Alembic migrations (some 70 of them: about 1.2 s of CPU on
the path to a tracked run's first metric). :func:`flasync.tracking.store.prepare_sqlite_store` keeps the first schema it
builds and copies it for later stores; this module covers the store before that one. A *seed* is the SQL text of an
empty schema as MLflow's migrations left it (``sqlite3``'s dump: the tables, indexes and the rows the migrations
insert, such as the schema version), stored under ``tracking/schemas`` by the key of the MLflow files that decide
the schema (:func:`schema_key`). When the installed MLflow has the key of a shipped seed, the seed is replayed into
the new store (a few milliseconds); when it has not (a newer MLflow with a migration of its own), MLflow's
migrations run as before.

A seed for the installed MLflow is written by::

    python -m tracking._schema_seed            # into tracking/schemas
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import sys
import tempfile
from pathlib import Path

__all__ = ["SEEDS", "dump_schema", "schema_key", "seed_file", "seed_schema", "write_seed"]

SEEDS = Path(__file__).with_name("schemas")
"""The seeds shipped with flasync."""


def schema_key() -> str:
    """Return 16 hex digits that change whenever the installed MLflow would build another schema: a hash of its
    migration scripts, the script environment that runs them and the tables created before the first migration."""
    import mlflow

    root = Path(mlflow.__file__).parent / "store"
    files = [
        root / "tracking" / "dbmodels" / "initial_models.py",
        root / "db_migrations" / "env.py",
        *sorted((root / "db_migrations" / "versions").glob("*.py")),
    ]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def seed_file(folder: Path = SEEDS) -> Path:
    """Return where the seed of the installed MLflow is (or would be) in ``folder``."""
    return folder / f"mlflow-schema-{schema_key()}.sql"


def dump_schema(db: Path) -> str:
    """Return the SQL text that rebuilds the store ``db``: its tables, indexes and rows."""
    with contextlib.closing(sqlite3.connect(db)) as connection:
        return "\n".join(connection.iterdump()) + "\n"


def seed_schema(target: Path, folder: Path = SEEDS) -> bool:
    """Build an empty store at ``target`` from the installed MLflow's seed in ``folder``; False (and no ``target``)
    when there is no seed for it, or it does not replay."""
    seed = seed_file(folder)
    try:
        script = seed.read_text(encoding="utf-8")
        with contextlib.closing(sqlite3.connect(target)) as connection:
            connection.executescript(script)
        return True
    except (OSError, sqlite3.Error):
        target.unlink(missing_ok=True)
        return False


def write_seed(folder: Path = SEEDS) -> Path:
    """Build a store with the installed MLflow's migrations and write its seed into ``folder``; return the file."""
    import mlflow

    with tempfile.TemporaryDirectory(prefix="flasync-schema-") as tmp:
        db = Path(tmp) / "mlflow.db"
        mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments(max_results=1)  # the migrations
        # Without the Default experiment, whose artifact location is the directory of the process that opened the
        # store first: MLflow makes it when a store without it is first opened.
        with contextlib.closing(sqlite3.connect(db)) as connection, connection:
            connection.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            connection.execute("DELETE FROM experiments WHERE experiment_id = 0")
        text = dump_schema(db)
    folder.mkdir(parents=True, exist_ok=True)
    path = seed_file(folder)
    path.write_text(text, encoding="utf-8")
    return path


def main() -> None:
    """Write the installed MLflow's seed into ``tracking/schemas`` (or the folder given as the one argument)."""
    import mlflow

    path = write_seed(Path(sys.argv[1]) if len(sys.argv) > 1 else SEEDS)
    print(f"{path} (MLflow {mlflow.__version__})")


if __name__ == "__main__":
    main()
