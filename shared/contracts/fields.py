"""What a record field is, read from its annotation alone: the SQL schema and the Parquet schema both derive from it.

A field says its width where it has one — ``Str200`` is at most 200 characters (SQL ``VARCHAR(200)``; a plain
``str`` is ``TEXT``), ``Int32`` fits 32 bits (SQL ``INTEGER``, Parquet ``int32``; a plain ``int`` is 64 bits) —
and pydantic enforces it, so a value that a column could not hold is refused where it is made, not at the
``INSERT``. ``SqlOnly`` marks a field that SQL keeps but the flat record leaves out (a nested dict).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

from annotated_types import Le, MaxLen
from pydantic import Field
from pydantic.fields import FieldInfo

INT32_MAX = 2**31 - 1

Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Str8 = Annotated[str, Field(max_length=8)]
Str16 = Annotated[str, Field(max_length=16)]
Str32 = Annotated[str, Field(max_length=32)]
Str64 = Annotated[str, Field(max_length=64)]
Str100 = Annotated[str, Field(max_length=100)]
Str200 = Annotated[str, Field(max_length=200)]


class SqlOnly:
    """A field's marker (``Annotated[..., SqlOnly]``): kept in SQL, left out of the flat record and Parquet."""


@dataclass(frozen=True)
class FieldShape:
    kind: type  # bool, int, float, str, a StrEnum, list or dict
    optional: bool  # None is allowed
    max_length: int | None = None  # a str's bound; None: unbounded text
    int32: bool = False  # an int that fits 32 bits
    item: type | None = None  # a list's item type
    sql_only: bool = False


def shape_of(info: FieldInfo) -> FieldShape:
    """The shape of a pydantic field: its type, optionality and widths, from the annotation and its metadata."""
    metadata = list(info.metadata)
    annotation = info.annotation
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        kinds = {_unwrapped(m, metadata) for m in members}
        kind = kinds.pop() if len(kinds) == 1 else _common_str(kinds, annotation)
    else:
        kind = _unwrapped(annotation, metadata)
    item = None
    if typing.get_origin(kind) is list:
        [item] = typing.get_args(kind)
        kind = list
    elif typing.get_origin(kind) is dict:
        kind = dict
    return FieldShape(
        kind=kind,
        optional=optional,
        max_length=next((m.max_length for m in metadata if isinstance(m, MaxLen)), None),
        int32=any(isinstance(m, Le) and m.le <= INT32_MAX for m in metadata),
        item=item,
        sql_only=any(m is SqlOnly for m in metadata),
    )


def _unwrapped(annotation: Any, metadata: list[Any]) -> Any:
    """``annotation`` without its ``Annotated`` layer, whose markers join ``metadata``."""
    if typing.get_origin(annotation) is Annotated:
        base, *extras = typing.get_args(annotation)
        for extra in extras:
            metadata.extend(extra.metadata if isinstance(extra, FieldInfo) else [extra])
        return base
    return annotation


def _common_str(kinds: set[Any], annotation: Any) -> type:
    """Several string enums in one field (a verdict or a cell status) are kept as their common type, str."""
    if all(isinstance(k, type) and issubclass(k, Enum) and issubclass(k, str) for k in kinds):
        return str
    raise TypeError(f"{annotation} has no single column type")
