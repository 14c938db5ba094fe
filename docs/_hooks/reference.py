"""Generate the reference pages that come from the code: the command line and every configuration field.

The configuration page is written from :mod:`flasync.config.explain`, the walk of the schema that
``flasync config explain`` prints from: the page and the command say the same.

Both pages are kept in the repository too, so that the links to them work where the Markdown is read as it is
(GitHub, an editor): ``python docs/_hooks/reference.py`` writes ``docs/reference/cli.md``, from
``python -m flasync ... --help``, and ``docs/reference/config.md``, from the pydantic models of
``flasync.config.RunConfig``; ``--check`` only tells which is stale (exit status 1). MkDocs loads this file as a hook
(``hooks:`` in ``mkdocs.yml``): ``on_files`` builds the site's pages from the code itself, whatever the kept files
hold. ``tests/docs/`` imports it to check that the configuration page covers every field and that the kept pages
are current.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import os
import re
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flasync.config.explain import bounds, config_models, is_sequence, kind_of, models_in, type_name

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (``docs/_hooks/`` is two levels below it)."""

_HELP_COLUMNS = "100"
_SUBCOMMAND = re.compile(r"^ {4}([a-z][a-z0-9-]*)(?:\s|$)")


# --- the command line ------------------------------------------------------------------------------------------


def _help(*command: str) -> str:
    """Return ``python -m flasync COMMAND... --help`` as flasync itself prints it."""
    env = dict(
        os.environ, COLUMNS=_HELP_COLUMNS, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-m", "flasync", *command, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.rstrip()


def _subcommands(help_text: str) -> list[str]:
    """Return the sub-commands a help text lists under its positional arguments (4-space indented names)."""
    names: list[str] = []
    in_positionals = False
    for line in help_text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            in_positionals = line == "positional arguments:"
            continue
        match = _SUBCOMMAND.match(line) if in_positionals else None
        if match:
            names.append(match.group(1))
    return names


def _command_tree() -> list[tuple[tuple[str, ...], str]]:
    """Return ``(command path, help text)`` for ``flasync`` and every command below it, in the order --help lists."""
    found: list[tuple[tuple[str, ...], str]] = [((), _help())]
    level = [()]
    with ThreadPoolExecutor(max_workers=4) as pool:
        while level:
            children = [(*parent, name) for parent in level for name in _subcommands(dict(found)[parent])]
            texts = list(pool.map(lambda path: _help(*path), children))
            found.extend(zip(children, texts, strict=True))
            level = children
    order = {path: i for i, (path, _) in enumerate(found)}
    return sorted(found, key=lambda item: [order[item[0][: i + 1]] for i in range(len(item[0]))])


def cli_markdown() -> str:
    """Return the command-line reference page: each command's ``--help``, as the installed flasync prints it."""
    lines = [
        "# Command line",
        "",
        "Generated from `python -m flasync ... --help` (`python docs/_hooks/reference.py` writes this page). Every "
        "command also runs as `flasync ...` once flasync is installed. A malformed command line is one line on "
        "standard error and exit status 2.",
        "",
    ]
    for path, text in _command_tree():
        title = " ".join(("flasync", *path))
        lines += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(lines)


# --- the configuration -----------------------------------------------------------------------------------------


def _default(info: Any) -> str:
    """Return a field's default as the page shows it: as code, unless it says there is none or it is a table."""
    from flasync.config.explain import default

    text = default(info)
    if text in ("required", "unset", "(table)") or text.endswith(" items"):
        return text
    return f"`{text}`"


def _code(text: str) -> str:
    """Return text as inline code that fits a table cell: HTML, since a Markdown table splits code at a ``|``."""
    return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"


def _cell(text: str) -> str:
    """Return text that fits one cell of a Markdown table."""
    return " ".join(text.replace("|", "\\|").split())


@functools.cache
def _roles_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("griffe_roles", Path(__file__).with_name("griffe_roles.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain_roles(text: str) -> str:
    """Show reST roles as inline code, as the API pages do (``docs/_hooks/griffe_roles.py``)."""
    return str(_roles_module().plain_roles(text))


def _first_paragraph(doc: str | None) -> str:
    return _cell(_plain_roles((doc or "").strip().split("\n\n")[0]))


def anchor(path: str, model: type) -> str:
    """Return the HTML id of a model's table, e.g. ``cfg-server-fedbuff`` or ``cfg-executor-ray``."""
    parts = [path.replace("[]", "").replace(".", "-") or "top"]
    kind = kind_of(model)
    if kind is not None:
        parts.append(kind)
    return "cfg-" + "-".join(parts).replace("_", "-")


def _heading(path: str, model: type) -> str:
    kind = kind_of(model)
    choice = f' (`kind = "{kind}"`)' if kind is not None else ""
    where = f"`{path}`" if path else "Top level"
    return f"### {where}{choice} {{ #{anchor(path, model)} }}"


def _description(path: str, info: Any, tables: dict[str, str]) -> str:
    """Return a field's description; a field holding a table points at that table's section."""
    if info.description:
        return _cell(info.description)
    first = tables.get(path)
    if first is not None:
        return f"see [`{path}`](#{first})"
    return ""


def config_markdown() -> str:
    """Return the configuration reference page: one table per section and per choice of ``kind``."""
    lines = [
        "# Configuration",
        "",
        "Generated from the pydantic models of `flasync.config.RunConfig` (`python docs/_hooks/reference.py` writes "
        "this page): every field, its type, its default, its bounds and its description. A run config is a TOML or "
        "YAML file of these sections; any field is also set with `--set path=value` (`--set server.buffer_size=20`). "
        "Unknown keys are errors. A table with a `kind` is one choice of a component: `kind` picks the choice, and "
        "the other fields belong to that choice. `path[]` is an item of a list. `python -m flasync config explain "
        "PATH` prints the same for one field or section (`python -m flasync config explain server.buffer_size`).",
        "",
    ]
    models = config_models()
    tables: dict[str, str] = {}
    for path, model in models:
        tables.setdefault(path, anchor(path, model))
    rendered: dict[type, tuple[str, str]] = {}
    for path, model in models:
        lines += [_heading(path, model), ""]
        if model in rendered:
            where, first = rendered[model]
            lines += [f"The same fields as [`{where}`](#{first}), under `{path}`.", ""]
            continue
        rendered[model] = (path, anchor(path, model))
        lines.append(f"<!-- config-model: {model.__name__} -->")
        summary = _first_paragraph(model.__doc__)
        name = f"`{model.__module__}.{model.__name__}`"
        lines += [f"{summary} ({name})" if summary else name, ""]
        lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
        for field, info in model.model_fields.items():
            dotted = f"{path}.{field}" if path else field
            child = dotted + ("[]" if is_sequence(info.annotation) else "")
            description = (
                "picks this choice" if field == "kind" and kind_of(model) else _description(child, info, tables)
            )
            lines.append(
                f"| `{dotted}` | {_code(type_name(info.annotation))} | {_cell(_default(info))} "
                f"| {_cell(bounds(info))} | {description} |"
            )
        lines.append("")
    return "\n".join(lines)


def missing_descriptions() -> list[str]:
    """Return ``Model.field`` for each value field (not ``kind``, not a table) whose model gives no description."""
    missing = []
    for model in dict.fromkeys(model for _, model in config_models()):
        for name, info in model.model_fields.items():
            chooses = name == "kind" and kind_of(model) is not None
            if not info.description and not chooses and not any(models_in(info.annotation)):
                missing.append(f"{model.__name__}.{name}")
    return missing


# --- the import layers ---------------------------------------------------------------------------------------


LAYERS_MARKER = "<!-- generated: import-layers -->"


def layers_markdown() -> str:
    """Return the import-linter contracts of ``pyproject.toml`` as a Markdown table and list, top layer first."""
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as file:
        contracts = tomllib.load(file)["tool"]["importlinter"]["contracts"]
    lines: list[str] = []
    for contract in contracts:
        if contract["type"] == "layers":
            lines += ["| layer (top first) | packages |", "|---|---|"]
            for number, layer in enumerate(contract["layers"], start=1):
                names = ", ".join(f"`{name.strip()}`" for name in layer.split("|"))
                lines.append(f"| {number} | {names} |")
            lines += ["", "The other contracts:", ""]
    for contract in contracts:
        if contract["type"] != "layers":
            lines.append(f"- {contract['name']} (`{contract['type']}`).")
    return "\n".join(lines)


# --- the MkDocs hook -------------------------------------------------------------------------------------------


PAGES = {"reference/cli.md": cli_markdown, "reference/config.md": config_markdown}
"""The pages made from the code, by their path under ``docs/``."""


def stale_pages(*, write: bool) -> list[str]:
    """Return the pages of :data:`PAGES` whose kept file under ``docs/`` is not what the code makes now; rewrite them
    too if ``write``."""
    stale = []
    for uri, make in PAGES.items():
        path = ROOT / "docs" / uri
        content = make()
        if not path.is_file() or path.read_text() != content:
            stale.append(uri)
            if write:
                path.write_text(content)
    return stale


def on_files(files: Any, config: Any) -> Any:
    """Build the generated pages of the site from the code, in place of the kept files (MkDocs hook)."""
    from mkdocs.structure.files import File

    sys.path.insert(0, str(ROOT))
    try:
        for uri, make in PAGES.items():
            kept = files.get_file_from_path(uri)
            if kept is not None:
                files.remove(kept)
            files.append(File.generated(config, uri, content=make()))
    finally:
        sys.path.remove(str(ROOT))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill in the generated parts of hand-written pages (MkDocs hook)."""
    if LAYERS_MARKER in markdown:
        markdown = markdown.replace(LAYERS_MARKER, layers_markdown())
    return markdown


def main(argv: list[str] | None = None) -> int:
    """Write the kept reference pages (``--check``: only tell which are stale); return the exit status."""
    import argparse

    parser = argparse.ArgumentParser(description="Write docs/reference/cli.md and config.md from the code.")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    check = parser.parse_args(argv).check
    sys.path.insert(0, str(ROOT))
    stale = stale_pages(write=not check)
    for uri in stale:
        print(f"docs/{uri} {'is stale' if check else 'written'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
