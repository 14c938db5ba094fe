"""Reading a config: TOML/YAML files (YAML within limits), ``--set`` overrides, validation and one-line errors."""

from __future__ import annotations

import contextlib
import difflib
import os
import tomllib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from flasync.config._base import _FieldError
from flasync.config.run import RunConfig
from flasync.config.tasks import check_task_model_kind
from flasync.core.errors import ConfigError

_YAML_MAX_DEPTH = 64


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader without anchors or aliases (a config needs neither; they allow expansion bombs) and
    with a bounded nesting depth (a deep document is refused before it costs a deep recursion)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise _YamlRefused(f"YAML aliases (*{event.anchor}) are not supported in configs", event.start_mark)
        event = self.peek_event()  # type: ignore[no-untyped-call]
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise _YamlRefused(f"YAML anchors (&{anchor}) are not supported in configs", event.start_mark)
        self._depth += 1
        if self._depth > _YAML_MAX_DEPTH:
            raise _YamlRefused(f"nested deeper than {_YAML_MAX_DEPTH} levels", event.start_mark)
        try:
            node: yaml.Node | None = super().compose_node(parent, index)
            return node
        finally:
            self._depth -= 1


class _YamlRefused(yaml.YAMLError):
    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        super().__init__(f"{message}{where}")


def safe_yaml(text: str) -> Any:
    """Parse YAML with PyYAML's safe loader, refusing anchors and aliases and nesting over 64 levels.

    Raises:
        yaml.YAMLError: If the text is not YAML, or uses what is refused (the message says which and where).
    """
    loader = _LimitedLoader(text)
    try:
        return loader.get_single_data()
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise yaml.YAMLError(str(exc).split(";")[0]) from None
    finally:
        loader.dispose()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a run configuration from a TOML/YAML file (or the defaults) and apply ``--set`` overrides.

    Relative data file paths in the file (``data.train``, ``data.test``) are made absolute against the file's
    folder, so a config and its data move together; paths given by ``overrides`` stay relative to the working
    directory.

    Args:
        path: A ``.toml``, ``.yaml`` or ``.yml`` file; ``None`` starts from the defaults.
        overrides: ``path.to.field=value`` strings; values are parsed as YAML scalars, lists or tables
            (``0.5``, ``true``, ``[64, 64]``, ``fedasync``, ``{kind: mlp}``), or as a TOML inline table
            (``{kind = "mlp", hidden = [64]}``).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: With a one-line message naming the file or field that is wrong.
    """
    return validate(config_data(path, overrides))


def config_data(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Return the plain mapping :func:`load_config` validates: the file's tables (its relative data paths made
    absolute) with ``overrides`` applied; a sweep applies each grid point's overrides to it.

    Raises:
        ConfigError: If the file cannot be read or an override is malformed.
    """
    data: dict[str, Any] = {} if path is None else _read_file(Path(path))
    if path is not None:
        _anchor_data_paths(data, Path(path).absolute().parent)
    for override in overrides:
        apply_override(data, override)
    return data


def validate(data: Mapping[str, Any]) -> RunConfig:
    """Validate a plain mapping into a :class:`RunConfig` (a ``sweep`` table, ``flasync sweep``'s, is left out).

    Raises:
        ConfigError: With a one-line message naming the first wrong field.
    """
    if "sweep" in data:  # `flasync sweep`'s section (flasync.config.sweep): a run is its base config
        data = {key: value for key, value in data.items() if key != "sweep"}
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        if any(error["loc"][:1] == ("model",) for error in exc.errors()):
            try:  # a model kind the task cannot train, named as such rather than by the fields its table lacks
                check_task_model_kind(data)
            except _FieldError as mismatch:
                raise ConfigError(str(mismatch)) from None
        raise ConfigError(format_validation_error(exc, data, model=RunConfig)) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config path is not a file: {path}")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    loaded: Any
    if suffix == ".toml":
        try:
            loaded = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        except RecursionError:
            raise ConfigError(f"{path}: invalid TOML: nested deeper than {_YAML_MAX_DEPTH} levels") from None
        except ValueError as exc:  # e.g. an integer of more digits than Python converts
            raise ConfigError(f"{path}: invalid TOML: {str(exc).split(';')[0]}") from None
        if _depth(loaded) > _YAML_MAX_DEPTH:
            raise ConfigError(f"{path}: invalid TOML: nested deeper than {_YAML_MAX_DEPTH} levels")
    elif suffix in (".yaml", ".yml"):
        try:
            loaded = safe_yaml(text)
        except yaml.YAMLError as exc:
            detail = " ".join(str(exc).split())
            raise ConfigError(f"{path}: invalid YAML: {detail}") from None
        if loaded is None:
            loaded = {}
    else:
        raise ConfigError(f"{path}: unsupported config format {suffix!r} (use .toml, .yaml or .yml)")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a table/mapping, got {type(loaded).__name__}")
    return loaded


def _depth(value: Any) -> int:
    """Return how deeply tables and arrays nest in a parsed document (a scalar: 0)."""
    depth, level = 0, [(value, 1)]
    while level:
        item, at = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            depth = max(depth, at)
            level.extend((child, at + 1) for child in children)
    return depth


def _anchor_data_paths(data: dict[str, Any], folder: Path) -> None:
    """Make the relative file paths a config file names (a ``files`` data section's, the remote tokens file, a
    device trace) absolute against ``folder``, in place."""
    places: list[tuple[dict[str, Any], str]] = []
    section = data.get("data")
    if isinstance(section, dict) and section.get("kind") == "files":
        places += [(section, "train"), (section, "test")]
    remote = data.get("remote")
    if isinstance(remote, dict):
        places.append((remote, "tokens_file"))
    population = data.get("population")
    if isinstance(population, dict):
        places.append((population, "trace"))
    for table, key in places:
        value = table.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            table[key] = os.path.normpath(folder / value)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set ``path.to.field=value`` in a nested mapping, in place.

    Raises:
        ConfigError: If the override is malformed or walks through a value that is not a table.
    """
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {override!r}: expected path.to.field=value")
    parts = key.split(".")
    if any(not p.strip() or not p.replace("_", "a").isalnum() for p in parts):
        raise ConfigError(f"--set {override!r}: {key!r} is not a dotted field path")
    value = _override_value(raw)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"--set {override!r}: {where} is a value, not a table")
        node = child
    node[parts[-1]] = value


def _override_value(raw: str) -> Any:
    """Read an override's value: a TOML inline table (``{kind = "mlp", hidden = [64]}``, as the config files write
    one) where it is one, else YAML (``[a, b]``, ``{kind: mlp}``, numbers, words), else the text as it is."""
    text = raw.strip()
    if not text:
        return ""
    if text.startswith("{") and "=" in text:
        with contextlib.suppress(tomllib.TOMLDecodeError, RecursionError, ValueError):
            table = tomllib.loads(f"value = {text}")["value"]
            if _depth(table) <= _YAML_MAX_DEPTH:
                return table
    try:
        return safe_yaml(raw)
    except (yaml.YAMLError, ValueError):  # not YAML, or a number too long for Python to convert: the raw text
        return raw


def format_validation_error(
    exc: ValidationError, data: Mapping[str, Any] | None = None, *, model: type[BaseModel] | None = None
) -> str:
    """Render a pydantic error as one line naming the field, e.g. ``server.buffer_size: must be >= 1 (got 0)``.

    With ``model`` (the validated class), an unknown field is followed by the closest known one of its table
    (``server.bufer_size: unknown field (did you mean buffer_size?)``), or by that table's fields.
    """
    errors = exc.errors()
    first = errors[0]
    ctx_error = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError):
        where, message = ".".join(ctx_error.loc), ctx_error.message
    else:
        where = ".".join(_strip_tags(first["loc"], data)) or "config"
        message = _message(first)
        if first["type"] == "extra_forbidden" and model is not None and first["loc"]:
            message += _known_fields_hint(str(first["loc"][-1]), _table_fields(model, first["loc"][:-1]))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {message}{more}"


def _known_fields_hint(name: str, fields: Sequence[str]) -> str:
    """Return `` (did you mean X?)`` for the field of ``fields`` closest to ``name``, else `` (fields: ...)``."""
    if not fields:
        return ""
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (fields: {', '.join(sorted(fields))})"


def _table_fields(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """Return the field names of the table at pydantic's ``loc`` (union tags and list indices included) under
    ``model``; [] where the path leads elsewhere than to a table."""
    node: Any = model
    for part in loc:
        node, tagged = _unwrap(node, part)
        if tagged:
            continue  # the part was a union's tag: the member it names is the table
        if isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[str(part)].annotation
        elif get_origin(node) in (list, tuple) and isinstance(part, int):
            node = get_args(node)[0]
        else:
            return []
    node, _ = _unwrap(node, None)
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _unwrap(node: Any, tag: int | str | None) -> tuple[Any, bool]:
    """Strip ``Annotated`` and ``None`` from ``node``; of a union of tables, take the member ``tag`` names (by
    ``kind`` or class name; then True: the tag is used up), else its only table (None if it has several)."""
    while get_origin(node) is Annotated:
        node = get_args(node)[0]
    if get_origin(node) not in (Union, types.UnionType):
        return node, False
    members = [m for m in get_args(node) if m is not type(None)]
    tables = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    for member in tables:
        kind = member.model_fields.get("kind")
        if tag is not None and (tag == member.__name__ or (kind is not None and kind.default == tag)):
            return member, True
    if len(members) == 1:
        return members[0], False
    return (tables[0] if len(tables) == 1 else None), False


def _strip_tags(loc: Sequence[int | str], data: Mapping[str, Any] | None) -> list[str]:
    """Drop discriminator tags (``server.fedbuff.buffer_size`` -> ``server.buffer_size``)."""
    out: list[str] = []
    node: Any = data
    last = len(loc) - 1
    for i, part in enumerate(loc):
        tag = isinstance(node, Mapping) and part not in node and node.get("kind", part) == part
        if tag and i < last:
            continue
        out.append(str(part))
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list | tuple) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return out


def _message(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":
        ctx = error.get("ctx") or {}
        return f"unknown kind {ctx.get('tag', error['input'])!r} (expected one of {ctx.get('expected_tags', '')})"
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if "input" in error and not isinstance(error["input"], Mapping):
        shown = repr(error["input"])
        got = shown if len(shown) <= 80 else shown[:60] + f"... ({len(shown)} characters)"
        if kind in _SEQUENCE_ERRORS and isinstance(error["input"], str | int | float) and len(shown) <= 80:
            got += f"; a list is written [a, b], e.g. [{error['input']}]"
        message += f" (got {got})"
    return message


_SEQUENCE_ERRORS = frozenset({"list_type", "tuple_type", "set_type", "frozen_set_type"})
"""pydantic's error types for a value that should have been a list: one value where a list was asked for is told how
a list is written (in a file and in ``--set``)."""
