"""Records are dataclasses; this module turns them into JSON and back, checking every field.

A record class names its kind and schema version as class variables (``KIND``, ``VERSION``).
:func:`to_json` writes its fields (nested records and lists of them included, tuples as
lists); :func:`from_json` rebuilds it and raises :class:`SchemaError` for a missing or unknown
field, so that a renamed field fails loudly where it is read instead of reading as ``None``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")


class SchemaError(ValueError):
    """A JSON document does not match the record it is read as."""


class Record:
    """Mixin for results records: subclasses are dataclasses with ``KIND`` and ``VERSION``."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def to_json(record: Any) -> dict[str, Any]:
    """The record's fields as JSON-ready values (NaN as null, infinities as "inf"/"-inf")."""
    if not dataclasses.is_dataclass(record):
        raise TypeError(f"expected a dataclass record, got {type(record).__name__}")
    return _plain(record)


def _dataclass_in(annotation: Any) -> tuple[type | None, bool]:
    """(the dataclass an annotation holds, whether as a list of them)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _dataclass_in(arg)
            if found[0] is not None:
                return found
        return None, False
    if origin in (list, tuple) and typing.get_args(annotation):
        inner = typing.get_args(annotation)[0]
        return (inner, True) if dataclasses.is_dataclass(inner) else (None, False)
    return (annotation, False) if dataclasses.is_dataclass(annotation) else (None, False)


def _float_back(value: Any, annotation: Any) -> Any:
    if float not in (typing.get_args(annotation) or (annotation,)):
        return value
    if value == "inf":
        return math.inf
    if value == "-inf":
        return -math.inf
    return value


def from_json(cls: type[T], data: Any, where: str = "record") -> T:
    """Rebuild ``cls`` from :func:`to_json`'s output; SchemaError names what does not fit."""
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: expected an object for {cls.__name__}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    required = {n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    if unknown or missing:
        raise SchemaError(f"{where}: {cls.__name__} fields do not match: missing {missing}, unknown {unknown}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        inner, many = _dataclass_in(hints[name])
        if inner is not None and value is not None:
            value = [from_json(inner, v, f"{where}.{name}[{i}]") for i, v in enumerate(value)] if many \
                else from_json(inner, value, f"{where}.{name}")
        elif isinstance(value, list) and typing.get_origin(hints[name]) is tuple:
            value = tuple(value)
        values[name] = _float_back(value, hints[name])
    return cls(**values)
