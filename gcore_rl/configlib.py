"""Typed configuration machinery: YAML data + `a.b.c=value` overrides → validated dataclasses.

This module knows nothing about any concrete config. A config is a `@dataclass` whose fields
carry a default and a ``metadata={"help": ...}`` string; it may define ``validate(self)`` that
raises `ConfigError` with a key relative to itself. `from_dict` checks every value against the
field's annotation, names the offending key with its full dotted path (list elements by index,
``reward.rules.0.fn``) and runs every ``validate`` from the leaves up.

Supported annotations: ``int``, ``float`` (also accepts ints and numeric strings such as
``"1e-3"``, which YAML reads as a string), ``bool``, ``str``, ``pathlib.Path``, ``X | None``,
other unions, ``Literal[...]``, ``list[X]``, ``tuple[X, ...]``, ``dict[K, X]``, ``Any`` and
nested dataclasses (also inside lists and dicts).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from gcore_rl.errors import ConfigError, did_you_mean

__all__ = ["apply_overrides", "check_import_path", "describe", "dump_yaml", "from_dict", "load_callable", "load_config",
           "to_dict", "yaml_text"]

T = TypeVar("T")

RECIPE_KEY = "<recipe>"
_NONE_TYPE = type(None)
_MISSING = dataclasses.MISSING


# --------------------------------------------------------------------------- type introspection


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (string annotations evaluated in its module)."""
    try:
        return typing.get_type_hints(cls)
    except NameError as exc:  # a forward reference that cannot be resolved at module level
        raise TypeError(f"cannot resolve the annotations of {cls.__qualname__}: {exc}") from exc


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not _MISSING or f.default_factory is not _MISSING


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    raise KeyError(f.name)


def _join(prefix: str, key: str | int) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _type_words(tp: Any) -> str:
    """The expected type, in words, for error messages ("a float", "an integer or null")."""
    if tp is Any or tp is object:
        return "any value"
    if tp is _NONE_TYPE or tp is None:
        return "null"
    if tp is bool:
        return "a boolean (true/false)"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a float"
    if tp is str:
        return "a string"
    if tp is Path:
        return "a path (string)"
    if _is_dataclass_type(tp):
        return f"a mapping (section {tp.__name__})"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    if _is_union(tp):
        args = typing.get_args(tp)
        words = [_type_words(a) for a in args if a is not _NONE_TYPE]
        if _NONE_TYPE in args:
            words.append("null")
        return " or ".join(words)
    return getattr(tp, "__name__", str(tp))


def _type_name(tp: Any) -> str:
    """A compact spelling of an annotation for `describe` (``float``, ``list[str]``, ``'a' | 'b'``)."""
    if tp is _NONE_TYPE or tp is None:
        return "None"
    if tp is Any:
        return "Any"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        args = typing.get_args(tp)
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _mismatch(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(key, f"expected {_type_words(tp)}, got {_show(value)}")


def _parses_as_float(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _literal_match(options: tuple, value: Any) -> bool:
    # `True == 1` in Python, so compare types as well as values.
    return any(type(opt) is type(value) and opt == value for opt in options)


def _shape_matches(tp: Any, value: Any, lenient: bool) -> bool:
    """Whether `value` has the right outer shape for `tp` (used to choose a member of a union)."""
    if tp is Any or tp is object:
        return True
    if tp is _NONE_TYPE:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        return lenient and isinstance(value, str) and _parses_as_float(value)
    if tp is str:
        return isinstance(value, str)
    if tp is Path:
        return isinstance(value, (str, Path))
    if _is_dataclass_type(tp):
        return isinstance(value, Mapping)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _literal_match(typing.get_args(tp), value)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, Mapping)
    if _is_union(tp):
        return any(_shape_matches(a, value, lenient) for a in typing.get_args(tp))
    return isinstance(tp, type) and isinstance(value, tp)


# --------------------------------------------------------------------------- from_dict


def from_dict(cls: type[T], data: Mapping[str, Any] | None, prefix: str = "") -> T:
    """Build and validate a `cls` instance from plain (YAML-loaded) data.

    `prefix` is the dotted path of `data` from the root, used in error keys. ``None`` counts as
    an empty mapping (a YAML section with no keys). Raises `ConfigError` for unknown or missing
    keys, values of the wrong type and failed ``validate()`` checks.
    """
    if not _is_dataclass_type(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    return _build(cls, {} if data is None else data, prefix)


def _build(cls: type[T], data: Any, prefix: str) -> T:
    if not isinstance(data, Mapping):
        raise _mismatch(prefix or "<root>", cls, data)
    fields = _init_fields(cls)
    names = [f.name for f in fields]
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(_join(prefix, key), f"keys must be strings, got {_show(key)}")
        if key not in names:
            hint = did_you_mean(key, names, lambda name: f"`{_join(prefix, name)}`")
            raise ConfigError(_join(prefix, key), f"unknown key{f' ({hint})' if hint else ''}; valid keys here are: "
                              + ", ".join(names))
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for f in fields:
        key = _join(prefix, f.name)
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], key)
        elif not _has_default(f):
            raise ConfigError(key, f"required key is missing (expected {_type_words(hints[f.name])})")
    try:
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            validate()
    except ConfigError as err:
        raise err.with_prefix(prefix) from None
    return obj


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against annotation `tp` and return it in its typed form."""
    if tp is Any or tp is object:
        return value
    if tp is _NONE_TYPE:
        if value is not None:
            raise _mismatch(key, tp, value)
        return None
    if _is_dataclass_type(tp):
        return _build(tp, value, key)
    if tp in (bool, int, float, str, Path):
        if not _shape_matches(tp, value, lenient=True):
            raise _mismatch(key, tp, value)
        if tp is float:
            return float(value)
        if tp is Path:
            return Path(value)
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if not _literal_match(args, value):
            raise _mismatch(key, tp, value)
        return value
    if _is_union(tp):
        if value is None and _NONE_TYPE in args:
            return None
        members = [a for a in args if a is not _NONE_TYPE]
        # Exact shapes first, so `float | str` keeps "abc" a string and `int | float` keeps 3 an int.
        for lenient in (False, True):
            for member in members:
                if _shape_matches(member, value, lenient):
                    return _convert(member, value, key)
        raise _mismatch(key, tp, value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _mismatch(key, tp, value)
        item_tp = args[0] if args else Any
        return [_convert(item_tp, item, _join(key, i)) for i, item in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _mismatch(key, tp, value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], item, _join(key, i)) for i, item in enumerate(value))
        if not args:
            return tuple(value)
        if len(args) != len(value):
            raise ConfigError(key, f"expected a list of {len(args)} items, got {len(value)}")
        return tuple(_convert(t, item, _join(key, i)) for i, (t, item) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _mismatch(key, tp, value)
        key_tp, val_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            sub = _join(key, k)
            if not _shape_matches(key_tp, k, lenient=False):
                raise ConfigError(sub, f"mapping keys must be {_type_words(key_tp)}, got {_show(k)}")
            out[k] = _convert(val_tp, v, sub)
        return out
    raise TypeError(f"config key `{key}`: unsupported annotation {tp!r}")


# --------------------------------------------------------------------------- overrides


def apply_overrides(
    data: Mapping[str, Any], overrides: Sequence[str], *, schema: type | None = None
) -> dict[str, Any]:
    """Return a copy of `data` with each ``a.b.c=value`` override applied (input is not mutated).

    Values are parsed with ``yaml.safe_load`` (``3`` → int, ``true`` → bool, ``null`` → None,
    ``[1, 2]`` → list; text YAML cannot parse stays a string). Missing intermediate sections are
    created; integer segments index lists (``reward.rules.0.weight=2``), and the index one past
    the end appends. With `schema` (the root dataclass), a section or list that the data leaves
    at its default is first filled in from that default, so overrides can reach into defaults.
    """
    out: dict[str, Any] = deepcopy(dict(data))
    for override in overrides:
        key, sep, raw = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(override, "expected KEY=VALUE")
        segments = key.split(".")
        if any(not s.strip() for s in segments):
            raise ConfigError(key, "empty segment in the dotted key")
        _set_by_path(out, [s.strip() for s in segments], _parse_value(raw), schema)
    return out


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _schema_step(tp: Any, segment: str) -> tuple[Any, Any]:
    """Type of `segment` under `tp`, and its default as plain data (`_MISSING` if none).

    Returns (None, _MISSING) once the schema no longer says anything useful.
    """
    if tp is None:
        return None, _MISSING
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not _NONE_TYPE]
        if len(members) != 1:
            return None, _MISSING
        tp = members[0]
    if _is_dataclass_type(tp):
        for f in _init_fields(tp):
            if f.name == segment:
                default = to_plain(_default_of(f)) if _has_default(f) else _MISSING
                return _field_types(tp)[f.name], default
        return None, _MISSING
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is list and args:
        return args[0], _MISSING
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0], _MISSING
    if origin is dict and len(args) == 2:
        return args[1], _MISSING
    return None, _MISSING


def _set_by_path(root: dict[str, Any], segments: list[str], value: Any, schema: type | None) -> None:
    node: Any = root
    tp: Any = schema
    for depth, seg in enumerate(segments):
        last = depth == len(segments) - 1
        here = ".".join(segments[: depth + 1])
        tp, default = _schema_step(tp, seg)
        if isinstance(node, dict):
            if last:
                node[seg] = value
                return
            if node.get(seg) is None:
                node[seg] = default if isinstance(default, (dict, list)) else {}
            node = node[seg]
        elif isinstance(node, list):
            try:
                index = int(seg)
            except ValueError:
                raise ConfigError(here, f"`{'.'.join(segments[:depth])}` is a list; expected an integer index, got {seg!r}") from None
            if not 0 <= index <= len(node):
                raise ConfigError(here, f"list index {index} is out of range (the list has {len(node)} items)")
            if last:
                if index == len(node):
                    node.append(value)
                else:
                    node[index] = value
                return
            if index == len(node):
                node.append({})
            elif node[index] is None:
                node[index] = {}
            node = node[index]
        else:
            parent = ".".join(segments[:depth])
            raise ConfigError(here, f"`{parent}` is {_show(node)}, not a section that has keys")


# --------------------------------------------------------------------------- files


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Read a YAML recipe (or start from defaults when `path` is None), apply overrides, build `cls`.

    An empty file counts as an empty mapping. File problems raise ``ConfigError("<recipe>", ...)``.
    """
    data: Any = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(RECIPE_KEY, f"recipe file not found: {p}") from None
        except IsADirectoryError:
            raise ConfigError(RECIPE_KEY, f"recipe path is a directory, not a YAML file: {p}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(RECIPE_KEY, f"cannot read recipe {p}: {exc}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            detail = " ".join(str(exc).split())
            raise ConfigError(RECIPE_KEY, f"{p} is not valid YAML: {detail}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(RECIPE_KEY, f"{p}: the top level must be a mapping of keys, got {type(data).__name__}")
    data = apply_overrides(data, overrides, schema=cls)
    return from_dict(cls, data)


def to_plain(value: Any) -> Any:
    """Dataclasses → dicts, tuples → lists, Paths → str, recursively; other values unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass instance as plain nested data (what `from_dict` reads back)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {type(obj).__name__}")
    return to_plain(obj)


def yaml_text(obj: Any) -> str:
    """`obj` (a dataclass instance) as YAML in field order (what `dump_yaml` writes)."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False, allow_unicode=True)


def dump_yaml(obj: Any, path: str | Path) -> None:
    """Write `obj` (a dataclass instance) as YAML in field order; parent folders are created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml_text(obj), encoding="utf-8")


# --------------------------------------------------------------------------- describe


def _format_default(value: Any) -> str:
    value = to_plain(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _nested_dataclass(tp: Any) -> tuple[type | None, str]:
    """The dataclass that a field's keys continue into, and how its key segment is written."""
    if _is_dataclass_type(tp):
        return tp, ""
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not _NONE_TYPE]
        if len(members) == 1:
            return _nested_dataclass(members[0])
        return None, ""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is list and args and _is_dataclass_type(args[0]):
        return args[0], "<i>"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and _is_dataclass_type(args[0]):
        return args[0], "<i>"
    if origin is dict and len(args) == 2 and _is_dataclass_type(args[1]):
        return args[1], "<name>"
    return None, ""


def describe(cls: type, prefix: str = "") -> str:
    """A plain-text reference of every key of `cls`: dotted key, type, default and help."""
    if not _is_dataclass_type(cls):
        raise TypeError(f"describe needs a dataclass type, got {cls!r}")
    lines: list[str] = []
    _describe_into(cls, prefix, lines, stack=())
    return "\n".join(lines).rstrip() + "\n"


def _describe_into(cls: type, prefix: str, lines: list[str], stack: tuple[type, ...]) -> None:
    hints = _field_types(cls)
    for f in _init_fields(cls):
        tp = hints[f.name]
        key = _join(prefix, f.name)
        nested, seg = _nested_dataclass(tp)
        help_text = str(f.metadata.get("help", "")).strip()
        if nested is not None and not seg and _is_dataclass_type(tp):
            head = f"{key}  [section {nested.__name__}]"
        else:
            default = _format_default(_default_of(f)) if _has_default(f) else "(required)"
            head = f"{key}: {_type_name(tp)} = {default}"
        lines.append(head)
        if help_text:
            lines.extend(textwrap.wrap(help_text, width=96, initial_indent="    ", subsequent_indent="    "))
        if nested is not None and nested not in (*stack, cls):
            lines.append("")
            _describe_into(nested, _join(key, seg) if seg else key, lines, (*stack, cls))
            continue
        lines.append("")


def check_import_path(path: str, key: str) -> tuple[str, str]:
    """Split `module:attr`, raising ConfigError(key) unless there is exactly one ':' with text on both sides."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ConfigError(key, f"`{path}` is not an import path of the form `package.module:function`")
    module_name, attr = path.split(":")
    if not module_name.strip() or not attr.strip():
        raise ConfigError(key, f"`{path}` is not an import path of the form `package.module:function`")
    return module_name.strip(), attr.strip()


def load_callable(path: str, key: str) -> Callable[..., Any]:
    """Import and return the callable named by ``"module:function"``.

    Raises ConfigError(key, ...) naming `path` when the format is wrong, the module cannot be
    imported, the attribute does not exist, or it is not callable.
    """
    module_name, attr = check_import_path(path, key)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(key, f"cannot import `{path}`: module `{module_name}` not found") from exc
        raise ConfigError(key, f"cannot import `{path}`: importing `{module_name}` failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(key, f"cannot import `{path}`: importing `{module_name}` raised {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(key, f"cannot import `{path}`: `{module_name}` has no attribute `{attr}`") from None
    if not callable(obj):
        raise ConfigError(key, f"`{path}` is not callable (it is a {type(obj).__name__})")
    return obj
