"""What every configuration field is, read from the schema: ``flasync config explain`` and the reference page.

The field descriptions, types, defaults and bounds live on the pydantic models of :class:`~flasync.config.RunConfig`;
this module walks them, so the command line (``python -m flasync config explain server.buffer_size``) and the
documentation's configuration reference print the same text, and neither is typed twice.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from flasync.core.errors import ConfigError

__all__ = [
    "FieldDoc",
    "bounds",
    "config_models",
    "default",
    "explain",
    "field_docs",
    "is_sequence",
    "kind_of",
    "models_in",
    "type_name",
]


class FieldDoc(NamedTuple):
    """One field of one section (or one choice of a section's ``kind``), as the schema says it."""

    path: str
    """Its dotted path, e.g. ``server.buffer_size`` (``path[]``: an item of a list)."""
    section: str
    """The path of the section it belongs to (empty: the top level)."""
    kind: str | None
    """The section's ``kind`` this field belongs to (None: a plain section)."""
    type: str
    """A short readable form of its type."""
    default: str
    """Its default as a config file would write it (``required``, ``unset``, a table's kind, ``N items``)."""
    bounds: str
    """Its numeric and length bounds, e.g. ``>= 1`` (empty: none)."""
    description: str
    """What it does (for a field holding a table: where that table is described)."""
    table: bool
    """The field holds a table (a section of its own) rather than a value."""


def models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """Yield the pydantic models an annotation names (through unions, ``Annotated``, lists and ``Optional``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from models_in(arg)


def type_name(annotation: Any) -> str:
    """Return a short readable form of a field's type, e.g. ``int | None`` or ``"uniform" | "weighted"``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    return str(getattr(annotation, "__name__", annotation))


def is_sequence(annotation: Any) -> bool:
    """Tell whether a field holds a list or tuple of items (``path[]``)."""
    return re.search(r"\b(list|tuple)\[", type_name(annotation)) is not None


def default(info: FieldInfo) -> str:
    """Return a field's default as a config file would write it."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        kind = getattr(value, "kind", None)
        return f'kind = "{kind}"' if kind is not None else "(table)"
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple) and value and isinstance(value[0], BaseModel):
        return f"{len(value)} items"
    return repr(value)


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}


def bounds(info: FieldInfo) -> str:
    """Return a field's numeric and length bounds, e.g. ``>= 1`` (powers of two from 2^32 written so)."""
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


def kind_of(model: type[BaseModel]) -> str | None:
    """Return the ``kind`` a model is chosen by in a discriminated union, or None for a plain section."""
    info = model.model_fields.get("kind")
    if info is None or typing.get_origin(info.annotation) is not typing.Literal:
        return None
    choices = typing.get_args(info.annotation)
    return str(choices[0]) if len(choices) == 1 else None


def config_models() -> list[tuple[str, type[BaseModel]]]:
    """Return every ``(dotted path, model)`` under ``RunConfig``, depth first, each pair once.

    A list field's items are at ``path[]``; a discriminated union gives one pair per choice of ``kind``.
    """
    from flasync.config.run import RunConfig

    seen: set[tuple[str, type[BaseModel]]] = set()
    ordered: list[tuple[str, type[BaseModel]]] = []

    def visit(path: str, model: type[BaseModel]) -> None:
        if (path, model) in seen:
            return
        seen.add((path, model))
        ordered.append((path, model))
        for name, info in model.model_fields.items():
            child = f"{path}.{name}" if path else name
            if is_sequence(info.annotation):
                child += "[]"
            for inner in models_in(info.annotation):
                visit(child, inner)

    visit("", RunConfig)
    return ordered


def field_docs() -> list[FieldDoc]:
    """Return every field of every section and choice, in the order of :func:`config_models`."""
    docs = []
    for section, model in config_models():
        kind = kind_of(model)
        for name, info in model.model_fields.items():
            path = f"{section}.{name}" if section else name
            table = any(models_in(info.annotation))
            if name == "kind" and kind is not None:
                description = f"picks this choice of {section or 'the run'}"
            elif info.description:
                description = " ".join(info.description.split())
            else:
                description = ""
            docs.append(
                FieldDoc(
                    path, section, kind, type_name(info.annotation), default(info), bounds(info), description, table
                )
            )
    return docs


def explain(path: str) -> str:
    """Return what the schema says of a field or a section, as ``flasync config explain PATH`` prints it.

    A field is printed with its type, default, bounds and description, once per choice of its section's ``kind``
    that has it; a section (``server``, ``population.speed``) lists its fields, choice by choice.

    Raises:
        ConfigError: No field or section has that path (the closest ones are named).
    """
    wanted = path.strip().replace("[]", "")
    docs = field_docs()
    fields = [doc for doc in docs if doc.path.replace("[]", "") == wanted]
    members = [doc for doc in docs if doc.section.replace("[]", "") == wanted]
    if fields or members:  # a field holding a table is both: the field, then the table's fields
        return "\n\n".join(
            [*(_field_text(doc) for doc in fields), *([_section_text(wanted, members)] if members else [])]
        )
    known = sorted({doc.path.replace("[]", "") for doc in docs} | {doc.section.replace("[]", "") for doc in docs})
    close = difflib.get_close_matches(wanted, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; sections: " + ", ".join(_top_sections(docs))
    raise ConfigError(f"config explain: no field or section {path!r}{hint}")


def _choice(doc: FieldDoc) -> str:
    return f'  (when {doc.section}.kind = "{doc.kind}")' if doc.kind is not None else ""


def _field_text(doc: FieldDoc) -> str:
    lines = [f"{doc.path}{_choice(doc)}", f"  type     {doc.type}", f"  default  {doc.default}"]
    if doc.bounds:
        lines.append(f"  bounds   {doc.bounds}")
    if doc.description:
        lines.append(f"  {doc.description}")
    elif doc.table:
        lines.append("  a table of its own: its fields follow")
    return "\n".join(lines)


def _section_text(section: str, members: list[FieldDoc]) -> str:
    blocks: dict[str | None, list[FieldDoc]] = {}
    for doc in members:
        blocks.setdefault(doc.kind, []).append(doc)
    out = []
    for kind, docs in blocks.items():
        title = f"{section or '(top level)'}" + (f'  (kind = "{kind}")' if kind is not None else "")
        width = max(len(doc.path) for doc in docs)
        rows = [title]
        for doc in docs:
            bound = f" ({doc.bounds})" if doc.bounds else ""
            picks = doc.kind is not None and doc.path.endswith(".kind")
            value = f"= {doc.default}" if picks else f"{doc.type} = {doc.default}"
            rows.append(f"  {doc.path:<{width}}  {value}{bound}  {doc.description}".rstrip())
        out.append("\n".join(rows))
    return "\n\n".join(out)


def _top_sections(docs: list[FieldDoc]) -> list[str]:
    return sorted({doc.path for doc in docs if not doc.section and doc.table})
