"""Generate the reference pages that come from the code: the command line and every configuration field.

MkDocs loads this file as a hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds ``reference/cli.md``, written
from ``python -m flasync ... --help``, and ``reference/config.md``, written from the pydantic models of
``flasync.config.RunConfig``. ``tests/docs/`` imports it to check that the configuration page covers every field.
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
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
        "Generated from `python -m flasync ... --help` when the site is built. Every command also runs as `flasync "
        "...` once flasync is installed. A malformed command line is one line on standard error and exit status 2.",
        "",
    ]
    for path, text in _command_tree():
        title = " ".join(("flasync", *path))
        lines += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(lines)


# --- the configuration -----------------------------------------------------------------------------------------


def _models_in(annotation: Any) -> Iterator[type]:
    """Yield the pydantic models an annotation names (through unions, ``Annotated``, lists and ``Optional``)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _is_sequence(annotation: Any) -> bool:
    """Return whether a field holds a list or tuple of items (``path[]`` in the page)."""
    return re.search(r"\b(list|tuple)\[", _type_name(annotation)) is not None


def _type_name(annotation: Any) -> str:
    """Return a short readable form of a field's type."""
    from pydantic import BaseModel

    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    return getattr(annotation, "__name__", str(annotation))


def _default(info: Any) -> str:
    """Return a field's default as it would be written in a config file."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        kind = getattr(value, "kind", None)
        return f'`kind = "{kind}"`' if kind is not None else "(table)"
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], BaseModel):
        return f"{len(value)} items"
    return f"`{value!r}`"


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}


def _bounds(info: Any) -> str:
    """Return a field's numeric and length bounds, e.g. ``>= 1``."""
    parts = []
    for item in info.metadata:
        for name, symbol in _BOUNDS.items():
            value = getattr(item, name, None)
            if value is None:
                continue
            if isinstance(value, float):
                parts.append(f"{symbol} {value:g}")
            elif value >= 2**32 and value & (value - 1) == 0:
                parts.append(f"{symbol} 2^{value.bit_length() - 1}")
            else:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


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


def config_models() -> list[tuple[str, type]]:
    """Return every ``(dotted path, model)`` under ``RunConfig``, depth first, each pair once.

    A list field's items are at ``path[]``; a discriminated union gives one pair per choice of ``kind``.
    """
    from flasync.config import RunConfig

    seen: set[tuple[str, type]] = set()
    ordered: list[tuple[str, type]] = []

    def visit(path: str, model: type) -> None:
        if (path, model) in seen:
            return
        seen.add((path, model))
        ordered.append((path, model))
        for name, info in model.model_fields.items():
            child = f"{path}.{name}" if path else name
            if _is_sequence(info.annotation):
                child += "[]"
            for inner in _models_in(info.annotation):
                visit(child, inner)

    visit("", RunConfig)
    return ordered


def _kind(model: type) -> str | None:
    """Return the ``kind`` a model is chosen by in a discriminated union, or None for a plain section."""
    info = model.model_fields.get("kind")
    if info is None or typing.get_origin(info.annotation) is not typing.Literal:
        return None
    choices = typing.get_args(info.annotation)
    return choices[0] if len(choices) == 1 else None


def anchor(path: str, model: type) -> str:
    """Return the HTML id of a model's table, e.g. ``cfg-server-fedbuff`` or ``cfg-executor-ray``."""
    parts = [path.replace("[]", "").replace(".", "-") or "top"]
    kind = _kind(model)
    if kind is not None:
        parts.append(kind)
    return "cfg-" + "-".join(parts).replace("_", "-")


def _heading(path: str, model: type) -> str:
    kind = _kind(model)
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
        "Generated from the pydantic models of `flasync.config.RunConfig` when the site is built: every field, "
        "its type, its default, its bounds and its description. A run config is a TOML or YAML file of these "
        "sections; any field is also set with `--set path=value` (`--set server.buffer_size=20`). Unknown keys "
        "are errors. A table with a `kind` is one choice of a component: `kind` picks the choice, and the other "
        "fields belong to that choice. `path[]` is an item of a list.",
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
            child = dotted + ("[]" if _is_sequence(info.annotation) else "")
            description = "picks this choice" if field == "kind" and _kind(model) else _description(child, info, tables)
            lines.append(
                f"| `{dotted}` | {_code(_type_name(info.annotation))} | {_cell(_default(info))} "
                f"| {_cell(_bounds(info))} | {description} |"
            )
        lines.append("")
    return "\n".join(lines)


def missing_descriptions() -> list[str]:
    """Return ``Model.field`` for each value field (not ``kind``, not a table) whose model gives no description."""
    missing = []
    for model in dict.fromkeys(model for _, model in config_models()):
        for name, info in model.model_fields.items():
            if not info.description and name != "kind" and not any(_models_in(info.annotation)):
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


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the site's files (MkDocs hook)."""
    from mkdocs.structure.files import File

    sys.path.insert(0, str(ROOT))
    try:
        for uri, content in (("reference/cli.md", cli_markdown()), ("reference/config.md", config_markdown())):
            files.append(File.generated(config, uri, content=content))
    finally:
        sys.path.remove(str(ROOT))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill in the generated parts of hand-written pages (MkDocs hook)."""
    if LAYERS_MARKER in markdown:
        markdown = markdown.replace(LAYERS_MARKER, layers_markdown())
    return markdown
