"""The method registry: one ``Method`` entry defines a sparse method, and everything else is derived from it.

A method is one module that declares its parameters (a ``MethodParams`` dataclass), its stages (a reference
select stage and optionally a reorder stage, each with an optional fast GPU twin), the name of its density knob
and its keep-everything setting, and ends with one call::

    register_method(Method(name="pbs", params=PBSParams, select=select_pbs, reorder=reorder_pbs, ...))

``SparseConfig`` then accepts ``method="pbs"`` and ``pbs={...}`` and ``config.params_of(PBSParams)`` reads them back;
``sparsity(method="pbs", threshold=...)`` works; ``keep_all()`` knows the setting that makes the method exact;
``calibrate`` and the benchmarks find the knob that sets its density; the break-even tables key its plans by its
select stage (``breakeven.plan_shape``); the examples offer it. Nothing else in the package names a method.

Adding a method with kernels of its own (``sampled`` is the example): ``sparse_compile/methods/<name>.py`` (its
parameters, its reference stages, its fast stages calling the kernels, the ``register_method`` call),
``kernels/<name>.py`` (the Triton kernels, imported by the fast stages on first use), and one line in
``sparse_compile/methods/__init__.py`` that imports the module (``tests/test_structure.py`` checks this for
``sampled``). A method registered from outside the package needs no line there (``tests/window_method.py``).

This module imports nothing from the package: the configuration reads it, the methods fill it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .state import STATE

__all__ = ["Method", "DensityKnob", "register_method", "method_spec", "registered_methods", "reorder_stage_names",
           "valid_pairs", "check_stage_pair", "reserve_names", "NO_REORDER"]

#: the reorder stage of methods that keep keys and queries in order
NO_REORDER = "none"


@dataclass(frozen=True)
class DensityKnob:
    """The parameter that sets a method's density: its name, its range, and which way keeps more blocks."""

    name: str
    low: float = 0.0
    high: float = 1.0
    higher_keeps_more: bool = True


def _planned_ahead(params: Any) -> bool:
    return False


@dataclass(frozen=True)
class Method:
    """One sparse method.

    name          what ``SparseConfig(method=...)`` and ``sparsity(method=...)`` take; also the keyword of its
                  parameters (``SparseConfig(pbs={...})``).
    params        its parameters: a frozen dataclass deriving from ``config.MethodParams``.
    select        reference select stage ``fn(q, k, scale, reordering, params) -> BlockPlan`` (the specification);
                  ``params`` is the method's own parameters (an instance of ``params``), never the configuration.
    reorder       reference reorder stage ``fn(q, k, scale, params) -> Reordering`` (its method's parameters), or
                  None (keys in order).
    fast_select / fast_reorder   GPU twins with the same signature and the same plans, or None.
    execute       the method's own executor ``fn(q, k, v, plan, scale, params, *, kernel, return_visited,
                  backend, kernel_options)`` (as ``plan.execute_plan`` takes them) when ``execute_plan``
                  alone would not do (S2O runs its plans in segment chunks), or None.
    select_after  reorder stages (besides its own) that its selector accepts, e.g. ``("none", "pbs")``.
    density       the knob that sets its density (benchmarks calibrate it).
    keep_all      the parameter values that keep every causal block: with them the method is exact.
    decided_at_run_time   ``fn(params) -> bool``: True when, with these parameters, its plans decide at run time
                  which tiles they visit (S2O's early stop), so that only running a plan tells its cost (the
                  break-even history then runs the plans it keeps).
    """

    name: str
    params: type
    select: Callable
    density: DensityKnob
    keep_all: Mapping[str, Any]
    reorder: Optional[Callable] = None
    fast_select: Optional[Callable] = None
    fast_reorder: Optional[Callable] = None
    execute: Optional[Callable] = None
    select_after: tuple[str, ...] = (NO_REORDER,)
    description: str = ""
    decided_at_run_time: Callable[[Any], bool] = _planned_ahead

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name == NO_REORDER:
            raise ValueError(f"Method.name: must be an identifier other than {NO_REORDER!r}, got {self.name!r}")
        if not callable(self.select):
            raise ValueError(f"Method {self.name!r}: select must be callable")
        names = getattr(self.params, "field_names", None)
        if names is None:
            raise ValueError(f"Method {self.name!r}: params must be a MethodParams dataclass")
        for key in list(self.keep_all) + [self.density.name]:
            if key not in names():
                raise ValueError(f"Method {self.name!r}: {key!r} is not a field of {self.params.__name__}")


_DEFINITION = "a definition, registered at import: the built-in methods and the ones registered since"
_METHODS: dict[str, Method] = STATE.add("registry.methods", {}, kept=_DEFINITION)
# SparseConfig's own field names (``reserve_names``, called by config.py)
_RESERVED: set[str] = STATE.add("registry.reserved", set(), kept=_DEFINITION)


def reserve_names(names) -> None:
    """Names no method may take: they are keywords of ``SparseConfig`` already (its fields)."""
    _RESERVED.update(names)


def register_method(method: Method) -> Method:
    """Add (or replace) a method. Its name becomes a valid ``method=`` and a keyword of ``SparseConfig``."""
    if method.name in _RESERVED:
        raise ValueError(f"register_method: {method.name!r} is a SparseConfig field name")
    _METHODS[method.name] = method
    return method


def registered_methods() -> dict[str, Method]:
    """name -> Method, in registration order."""
    return dict(_METHODS)


def method_spec(name: str) -> Method:
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid: {list(_METHODS)}") from None


def reorder_stage_names() -> tuple[str, ...]:
    return (NO_REORDER,) + tuple(m.name for m in _METHODS.values() if m.reorder is not None)


def valid_pairs() -> set[tuple[str, str]]:
    """(reorder, select) stage pairs: a selector after its own reorder or after one it declares (if registered)."""
    reorders = set(reorder_stage_names())
    pairs = set()
    for m in _METHODS.values():
        own = m.name if m.reorder is not None else NO_REORDER
        pairs.add((own, m.name))
        pairs.update((r, m.name) for r in m.select_after if r in reorders)
    return pairs


def check_stage_pair(reorder: str, select: str) -> None:
    """ValueError naming the valid pairs unless (reorder, select) is one of them."""
    if reorder not in reorder_stage_names():
        raise ValueError(f"unknown reorder stage {reorder!r}; valid: {sorted(reorder_stage_names())}")
    if select not in _METHODS:
        raise ValueError(f"unknown select stage {select!r}; valid: {sorted(_METHODS)}")
    if (reorder, select) not in valid_pairs():
        pairs = ", ".join(f"{r}+{s}" for r, s in sorted(valid_pairs()))
        raise ValueError(f"reorder {reorder!r} cannot be combined with select {select!r}; valid pairs "
                         f"(reorder+select): {pairs}")
