"""The generated reference pages: the config page covers every field of the schema, the CLI page every command."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from flasync.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
_MODEL = re.compile(r"^<!-- config-model: (\w+) -->$")
_ROW = re.compile(r"^\| `([\w.\[\]]+)` \|")


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "_hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema_fields() -> dict[str, set[str]]:
    """Return each model of RunConfig's JSON schema (by title) with its property names."""
    schema: dict[str, Any] = RunConfig.model_json_schema()
    models = {schema["title"]: set(schema["properties"])}
    for definition in schema.get("$defs", {}).values():
        if "properties" in definition:
            models[definition["title"]] = set(definition["properties"])
    return models


def _page_fields(page: str) -> dict[str, set[str]]:
    """Return each model the page has a table for, with the last part of every field path in that table."""
    models: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in page.splitlines():
        marker = _MODEL.match(line)
        if marker:
            current = models.setdefault(marker.group(1), set())
            continue
        row = _ROW.match(line)
        if row and current is not None:
            current.add(row.group(1).rsplit(".", 1)[-1])
        elif line.startswith("#"):
            current = None
    return models


def test_config_page_covers_every_field_of_the_schema() -> None:
    """Every model of the JSON schema has a table, and every property of it a row (100% of the fields)."""
    expected = _schema_fields()
    rendered = _page_fields(_reference().config_markdown())
    missing = {model: sorted(fields - rendered.get(model, set())) for model, fields in expected.items()}
    missing = {model: fields for model, fields in missing.items() if fields}
    assert not missing, f"fields of the schema missing from reference/config.md: {missing}"
    total = sum(len(fields) for fields in expected.values())
    assert total == sum(len(rendered[model] & fields) for model, fields in expected.items())


def test_every_config_field_has_a_description() -> None:
    """The config reference, ``--help``-style tooling and users read each field's description: none is left empty."""
    assert _reference().missing_descriptions() == []


def test_config_page_lists_no_field_the_schema_lacks() -> None:
    """A row names a field that exists (the page is generated, never stale)."""
    expected = _schema_fields()
    rendered = _page_fields(_reference().config_markdown())
    extra = {model: sorted(fields - expected.get(model, set())) for model, fields in rendered.items()}
    assert not {model: fields for model, fields in extra.items() if fields}


def test_config_page_shows_defaults() -> None:
    """A field's default is the model's default, as a config file would write it."""
    page = _reference().config_markdown()
    assert "| `server.buffer_size` | <code>int</code> | `10` |" in page
    assert '| `clock` | <code>&quot;virtual&quot; &#124; &quot;wall&quot;</code> | `"virtual"` |' in page


@pytest.mark.slow
def test_cli_page_has_every_command() -> None:
    """The command-line page holds the --help of flasync and of each of its commands, as flasync prints them."""
    page = _reference().cli_markdown()
    for command in (
        "run",
        "serve",
        "client",
        "report",
        "compare",
        "tracking",
        "tracking replay",
        "tracking mark-failed",
    ):
        assert f"## `flasync {command}`" in page
    assert "--set PATH=VALUE" in page


def test_the_kept_config_page_is_the_one_the_code_makes() -> None:
    """``docs/reference/config.md`` is kept in the repository (its links work where the Markdown is read as it is) and
    is what the schema makes now: after a change of the config, ``python docs/_hooks/reference.py`` rewrites it."""
    kept = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert kept == _reference().config_markdown(), "docs/reference/config.md is stale: run docs/_hooks/reference.py"


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the kept page holds Python 3.11's argparse formatting")
def test_the_kept_cli_page_is_the_one_the_code_makes() -> None:
    """``docs/reference/cli.md`` is what each command's ``--help`` prints now (as Python 3.11 formats it, the Python
    CI runs): after a change of the command line, ``python docs/_hooks/reference.py`` rewrites it."""
    kept = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert kept == _reference().cli_markdown(), "docs/reference/cli.md is stale: run docs/_hooks/reference.py"
