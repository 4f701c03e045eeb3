"""A method's parameters: the base class of every method's parameter dataclass and the field checks they use.

``MethodParams`` checks each field's annotated type (numbers finite, integers within the kernels' 32 bits), each
field's own range (``field_checks``: one ``check(owner, name, value)`` per field, built from the ``*_field``
factories below) and the rules between fields (``check_fields``). A method module declares its parameters with
these and registers them (``registry.Method.params``); ``SparseConfig`` holds one instance per registered method.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import fields
from typing import Any, Callable, ClassVar, Mapping, Optional

__all__ = ["MethodParams", "MAX_BLOCK", "MAX_INT", "MAX_SPAN", "MAX_TILES", "SPAN_REASON", "TILES_REASON", "fail",
           "check_block", "check_fraction", "check_stride", "check_share", "check_int", "check_finite", "block_field",
           "fraction_field", "int_field", "finite_field", "optional_field", "span_field", "tiles_field"]

#: the largest block / tile the attention kernel takes (``kernels/attention.py``: powers of two in [16, 256])
MAX_BLOCK = 256
#: integer parameters reach the kernels as 32-bit integers
MAX_INT = 2**31 - 1
#: the longest span, in tokens, that a size parameter may name: a segment (PBS, S2O) or a coarse block (BFLA).
#: Plans lay such a span out whole, padded past the prompt's end (S2O pools the queries of whole segments and lists
#: S / block_n tiles per query block; BFLA pads queries and keys to whole coarse blocks and scores their groups
#: pairwise), so what a plan costs grows with the size asked for, not with the prompt: unbounded, a 200-token
#: prompt asked for 8.6 GB (S2O, S = 2**30) and 8.8 TB (BFLA, b = 2**20, g = 1). 2**16 is 32 times S2O's default
#: segment and 256 times PBS's and BFLA's defaults; a span at least as long as the prompt is one segment (block)
#: of it whatever its size, so on prompts under 64K tokens a longer one plans nothing a 2**16 one does not.
MAX_SPAN = 2**16
SPAN_REASON = f"the longest segment or coarse block supported is MAX_SPAN = 2**16 = {MAX_SPAN} tokens"
#: the most tiles a tile count may name (a local band, sink tiles, exact tail blocks): more than any prompt has
#: (2**20 tiles of >= 16 tokens are 16M tokens), and small enough that a count times a block (<= 2**28) stays in
#: the kernels' 32-bit arithmetic (``kernels/sampled.py`` forms (first tile - LOCAL) * BLOCK_N in int32)
MAX_TILES = 2**20
TILES_REASON = (f"a count of tiles, times the block size, must stay in the kernels' 32-bit arithmetic: "
                f"at most MAX_TILES = 2**20 = {MAX_TILES} tiles, more than any prompt has")


def fail(owner: str, name: str, problem: str) -> None:
    raise ValueError(f"{owner}.{name}: {problem}")


def _because(why: str) -> str:
    return f" ({why})" if why else ""


def check_block(owner: str, name: str, value: Any, *, high: Optional[int] = MAX_BLOCK, why: str = "") -> None:
    """A power of two in [16, high]; ``why`` (the reason for ``high``) joins the error."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < 16 or value & (value - 1)
            or (high is not None and value > high)):
        where = f"in [16, {high}]" if high is not None else ">= 16"
        fail(owner, name, f"must be a power of two {where}, got {value!r}{_because(why)}")


def check_fraction(owner: str, name: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (low <= value <= high):
        fail(owner, name, f"must be a number in [{low}, {high}], got {value!r}")


def check_stride(owner: str, name: str, value: Any) -> None:
    """A power of two in [1, MAX_BLOCK]: a sampling or scoring stride inside a tile (the params check it against
    their ``block_size``)."""
    check_int(owner, name, value, low=1, high=MAX_BLOCK)
    if value & (value - 1):
        fail(owner, name, f"must be a power of two in [1, {MAX_BLOCK}] (and <= block_size), got {value!r}")


def check_share(owner: str, name: str, value: Any) -> None:
    """A share in (0, 1]: a fixed-share selector's budget (1 keeps everything, 0 would keep nothing)."""
    if not 0.0 < value <= 1.0:
        fail(owner, name, f"must be a number in (0, 1], got {value!r}")


def check_int(owner: str, name: str, value: Any, *, low: int = 0, high: int = MAX_INT, why: str = "") -> None:
    """An integer in [low, high]; ``why`` (the reason for the bound) joins the error."""
    if not isinstance(value, int) or isinstance(value, bool) or not (low <= value <= high):
        fail(owner, name, f"must be an integer in [{low}, {high}], got {value!r}{_because(why)}")


def check_finite(owner: str, name: str, value: Any, *, sign: int = 0) -> None:
    """A finite number; ``sign`` 1: > 0, -1: < 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and sign:
        ok = value * sign > 0
    if not ok:
        what = {1: "a positive finite number", -1: "a negative finite number", 0: "a finite number"}[sign]
        fail(owner, name, f"must be {what}, got {value!r}")


# field checks for ``MethodParams.field_checks``: each is ``check(owner, name, value)``
def block_field(high: Optional[int] = MAX_BLOCK, why: str = "") -> Callable:
    return functools.partial(check_block, high=high, why=why)


def fraction_field(low: float = 0.0, high: float = 1.0) -> Callable:
    return functools.partial(check_fraction, low=low, high=high)


def int_field(low: int = 0, high: int = MAX_INT, why: str = "") -> Callable:
    return functools.partial(check_int, low=low, high=high, why=why)


def span_field(why: str = "", low: int = 16) -> Callable:
    """A segment's length in tokens, an integer in [low, MAX_SPAN] (its rules against the blocks are the params');
    ``why``: what a longer one would cost in this method, joined to ``SPAN_REASON`` in the error."""
    return int_field(low=low, high=MAX_SPAN, why=f"{why}; {SPAN_REASON}" if why else SPAN_REASON)


def tiles_field() -> Callable:
    """A count of tiles in [0, MAX_TILES]."""
    return int_field(low=0, high=MAX_TILES, why=TILES_REASON)


def finite_field(sign: int = 0) -> Callable:
    return functools.partial(check_finite, sign=sign)


def optional_field(check: Callable) -> Callable:
    def checked(owner: str, name: str, value: Any) -> None:
        if value is not None:
            check(owner, name, value)

    return checked


def _check_field_type(owner: str, f: dataclasses.Field, value: Any, *, limits: bool = True) -> None:
    """``value`` is of ``f``'s annotated kind (``bool`` is no number, ``'no'`` is no bool); with ``limits`` (a field
    without its own range check) numbers are finite and integers fit the kernels' 32 bits."""
    kinds = [k.strip() for k in str(f.type).replace("Optional[", "").rstrip("]").split("|")]
    if value is None and ("None" in kinds or "Optional" in str(f.type)):
        return
    if "bool" in kinds:
        if not isinstance(value, bool):
            fail(owner, f.name, f"must be True or False, got {value!r}")
    elif "int" in kinds and "float" not in kinds:
        if not isinstance(value, int) or isinstance(value, bool):
            fail(owner, f.name, f"must be an integer, got {value!r}")
        if limits and abs(value) > MAX_INT:
            fail(owner, f.name, f"must be an integer in [-{MAX_INT}, {MAX_INT}], got {value!r}")
    elif "float" in kinds:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            fail(owner, f.name, f"must be a number, got {value!r}")
        if limits and not math.isfinite(value):
            fail(owner, f.name, f"must be a finite number, got {value!r}")


def _check_annotated_types(obj: Any, checked: Mapping[str, Any] = {}) -> None:
    owner = type(obj).__name__
    for f in fields(obj):
        _check_field_type(owner, f, getattr(obj, f.name), limits=f.name not in checked)


class MethodParams:
    """Base of a method's parameter dataclass: field types checked (numbers finite), each field's own range
    (``field_checks``), construction from a mapping with a clear error for unknown keys. Subclasses put rules that
    relate fields in ``check_fields`` (or their own ``__post_init__``, calling ``super()``)."""

    #: field name -> ``check(owner, name, value)`` of that field alone (its range). Run on construction, and by
    #: ``check_value`` for a value given before the other fields are known (a ``sparsity`` region's parameter).
    field_checks: ClassVar[Mapping[str, Callable]] = {}

    def __post_init__(self) -> None:
        _check_annotated_types(self, self.field_checks)
        for name, check in self.field_checks.items():
            check(type(self).__name__, name, getattr(self, name))
        self.check_fields()

    def check_fields(self) -> None:
        """Rules between fields (after every field passed its own checks)."""

    @classmethod
    def check_value(cls, name: str, value: Any) -> None:
        """ValueError naming the field and its valid range when ``value`` is not valid for field ``name`` alone."""
        by_name = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        if name not in by_name:
            raise ValueError(f"{cls.__name__}: unknown parameter {name!r}; valid: {list(by_name)}")
        check = cls.field_checks.get(name)
        _check_field_type(cls.__name__, by_name[name], value, limits=check is None)
        if check is not None:
            check(cls.__name__, name, value)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def updated(self, overrides: Mapping[str, Any]):
        unknown = sorted(set(overrides) - set(self.field_names()), key=str)  # a key may be any object
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown parameter(s) {unknown}; valid: {list(self.field_names())}"
            )
        return dataclasses.replace(self, **dict(overrides))  # type: ignore[type-var]
