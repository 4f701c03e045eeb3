"""Deprecated: the names this module held, each from the module that holds it now (a ``DeprecationWarning`` says
which). The op is ``attention_op``, the per-call pipeline ``pipeline``, ``sparse_attention`` and ``precompile``
``api``, ``ulysses_attention`` ``parallel``, the configuration's JSON ``SparseConfig.to_json`` / ``from_json``."""

from __future__ import annotations

import importlib
import warnings
from typing import Optional

__all__ = ["causal_attention", "sparse_attention", "ulysses_attention", "precompile", "config_to_json",
           "config_from_json", "decide", "capturing"]

_MODULES = {  # where each name lives now
    "attention_op": ("causal_attention", "output_layout", "in_output_layout"),
    "api": ("sparse_attention", "precompile", "precompile_kernels"),
    "parallel": ("ulysses_attention",),
    "pipeline": ("capturing", "dispatch", "padded_dispatch", "DENSE", "SPARSE"),
}
_MOVED = {name: module for module, names in _MODULES.items() for name in names}
_RENAMED = {"dispatch": "attend", "padded_dispatch": "attend_padded"}


def config_to_json(config) -> str:
    return config.to_json()


def config_from_json(text: str):
    from .config import SparseConfig

    return SparseConfig.from_json(text)


def decide(q, k, v, config, site: str = "", *, chunked_allowed: bool = False,
           scale: Optional[float] = None) -> tuple[str, str]:
    """(path, reason) of one call's rules."""
    from .pipeline import DENSE, SPARSE, dense_reason

    why = dense_reason(q, k, v, config, site, chunked_allowed=chunked_allowed, scale=scale)
    return (DENSE, why) if why is not None else (SPARSE, f"method {config.method}")


def run_sparse(q, k, v, scale, config, history_key=None, *, plan_only: bool = False):
    """(output or None, reason, per-head density or None): ``pipeline.run_method``'s ``Outcome`` as a tuple."""
    from .pipeline import run_method

    outcome = run_method(q, k, v, scale, config, history_key, plan_only=plan_only)
    return outcome.output, ("re-planned" if outcome.replanned else outcome.reason), outcome.density


_REPLACED = {"config_to_json": "SparseConfig.to_json", "config_from_json": "SparseConfig.from_json",
             "decide": "pipeline.dense_reason", "run_sparse": "pipeline.run_method"}


def __getattr__(name: str):
    if name in _MOVED:
        module, attribute = _MOVED[name], _RENAMED.get(name, name)
        warnings.warn(f"sparse_compile.ops.{name} is deprecated: use sparse_compile.{module}.{attribute}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _deprecated(function):
    def warned(*args, **kwargs):
        warnings.warn(f"sparse_compile.ops.{function.__name__} is deprecated: use "
                      f"sparse_compile.{_REPLACED[function.__name__]}", DeprecationWarning, stacklevel=2)
        return function(*args, **kwargs)

    warned.__name__ = warned.__qualname__ = function.__name__
    warned.__doc__ = function.__doc__
    return warned


config_to_json = _deprecated(config_to_json)
config_from_json = _deprecated(config_from_json)
decide = _deprecated(decide)
run_sparse = _deprecated(run_sparse)
