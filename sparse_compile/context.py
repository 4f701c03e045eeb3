"""``sparsity(...)``: change what compiled code does inside a ``with`` block, at run time, without recompiling.

The state lives in a ``contextvars.ContextVar``: each thread and each asyncio task sees its own, nesting is a
stack of tokens, and leaving a block restores the previous state exactly (even on exceptions).
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Optional

from .config import METHOD_NAMES, SparseConfig

__all__ = ["sparsity", "RegionState", "current_region"]


@dataclass(frozen=True)
class RegionState:
    """What the innermost ``sparsity`` block asks for; ``None`` fields defer to the compiled configuration."""

    enabled: Optional[bool] = None
    method: Optional[str] = None
    params: tuple[tuple[str, Any], ...] = ()

    def apply(self, config: SparseConfig) -> SparseConfig:
        if self.method is None and not self.params and self.enabled is None:
            return config
        out = config.with_overrides(self.method, dict(self.params))
        if self.enabled is not None and out.enabled != self.enabled:
            out = out.with_overrides(None, {"enabled": self.enabled})
        return out


_REGION: contextvars.ContextVar[RegionState] = contextvars.ContextVar("sparse_compile_region", default=RegionState())


def current_region() -> RegionState:
    return _REGION.get()


def _valid_param_names() -> set[str]:
    config = SparseConfig()
    names = set(SparseConfig.field_names()) - {"method", "pbs", "sparge", "bfla", "s2o", "xattention"}
    for stage in ("pbs", "sparge", "bfla", "s2o", "xattention"):
        names |= set(getattr(config, stage).field_names())
    return names


class sparsity:
    """Context manager (and decorator) that changes sparse attention for a region of code.

    ``with sparse_compile.sparsity(enabled=False): model(x)`` runs every rewritten attention densely;
    ``with sparse_compile.sparsity(method="bfla", mass_threshold=0.95): ...`` switches method and parameters.
    Keyword parameters are ``SparseConfig`` fields (``min_seq_len=...``) or fields of the active method's
    parameters (``threshold=...`` for pbs). Blocks nest: inner values win, parameters merge.
    It acts at run time on code already compiled with ``backend="sparse_prefill"`` (and on
    ``sparse_attention``); enter it around the compiled call, not inside the traced function.
    """

    def __init__(self, enabled: bool = True, method: Optional[str] = None, **params: Any) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"sparsity(enabled=...): must be a bool, got {enabled!r}")
        if method is not None and method not in METHOD_NAMES:
            raise ValueError(f"sparsity(method=...): unknown method {method!r}; valid: {list(METHOD_NAMES)}")
        unknown = sorted(set(params) - _valid_param_names())
        if unknown:
            raise ValueError(f"sparsity(): unknown parameter(s) {unknown}; valid: {sorted(_valid_param_names())}")
        if method is not None:
            # fail here, not inside compiled code, when a parameter does not belong to the named method
            SparseConfig(method=method).with_overrides(None, params)
        self._enabled = enabled
        self._method = method
        self._params = dict(params)
        self._tokens: list[contextvars.Token] = []

    def _state(self, outer: RegionState) -> RegionState:
        merged = dict(outer.params)
        if self._method is not None and self._method != outer.method:
            # another method: the outer block's method parameters no longer apply, its general ones still do
            merged = {k: v for k, v in merged.items() if k in SparseConfig.field_names()}
        merged.update(self._params)
        return RegionState(
            enabled=self._enabled,
            method=self._method if self._method is not None else outer.method,
            params=tuple(sorted(merged.items())),
        )

    def __enter__(self) -> "sparsity":
        self._tokens.append(_REGION.set(self._state(_REGION.get())))
        return self

    def __exit__(self, *exc) -> None:
        _REGION.reset(self._tokens.pop())

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with sparsity(self._enabled, self._method, **self._params):
                return fn(*args, **kwargs)

        return wrapped

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self._params.items())
        return f"sparsity(enabled={self._enabled}, method={self._method!r}{extra})"


@functools.lru_cache(maxsize=256)
def _resolve_cached(config: SparseConfig, region: RegionState) -> SparseConfig:
    return region.apply(config)


def resolve(config: SparseConfig) -> SparseConfig:
    """The configuration in force here: ``config`` with the innermost ``sparsity`` block applied."""
    return _resolve_cached(config, _REGION.get())
