"""``sparsity(...)``: change what compiled code does inside a ``with`` block, at run time, without recompiling.

The state lives in a ``contextvars.ContextVar``: each thread and each asyncio task sees its own, nesting is a
stack of tokens, and leaving a block restores the previous state exactly (even on exceptions).
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Optional

from .config import SparseConfig, normalize_site_params
from .registry import registered_methods

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
        try:
            out = config.with_overrides(self.method, dict(self.params))
        except ValueError as exc:  # each value was valid alone (checked on entry); together with this config not
            given = ", ".join(f"{k}={v!r}" for k, v in self.params)
            raise ValueError(f"the sparsity region in force (method={self.method!r}, {given}) does not fit the "
                             f"compiled configuration (method {config.method!r}): {exc}") from None
        if self.enabled is not None and out.enabled != self.enabled:
            out = out.with_overrides(None, {"enabled": self.enabled})
        return out


_REGION: contextvars.ContextVar[RegionState] = contextvars.ContextVar("sparse_compile_region", default=RegionState())


def current_region() -> RegionState:
    return _REGION.get()


def _valid_param_names() -> set[str]:
    methods = registered_methods()
    names = set(SparseConfig.field_names()) - set(methods) - {"method"}
    for spec in methods.values():
        names |= set(spec.params.field_names())
    return names


class sparsity:
    """Context manager (and decorator) that changes sparse attention for a region of code.

    ``with sparse_compile.sparsity(enabled=False): model(x)`` runs every rewritten attention densely;
    ``with sparse_compile.sparsity(method="bfla", mass_threshold=0.95): ...`` switches method and parameters.
    Keyword parameters are ``SparseConfig`` fields (``min_seq_len=...``, ``skip_layers=...``) or fields of the
    active method's parameters (``threshold=...`` for pbs). Blocks nest: what a block leaves unspecified (its
    ``enabled`` too) is inherited from the enclosing block; inner values win, parameters merge.
    It acts at run time on code already compiled with ``backend="sparse_prefill"`` (and on
    ``sparse_attention``); enter it around the compiled call, not inside the traced function. Blocks must be
    left in the reverse order of entering (``with`` does that); leaving an outer one first is an error.
    """

    def __init__(self, enabled: Optional[bool] = None, method: Optional[str] = None, **params: Any) -> None:
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"sparsity(enabled=...): must be True, False or None (inherit), got {enabled!r}")
        methods = registered_methods()
        if method is not None and method not in methods:
            raise ValueError(f"sparsity(method=...): unknown method {method!r}; valid: {list(methods)}")
        unknown = sorted(set(params) - _valid_param_names())
        if unknown:
            raise ValueError(f"sparsity(): unknown parameter(s) {unknown}; valid: {sorted(_valid_param_names())}")
        if method is not None:
            # fail here, not inside compiled code, when a parameter does not belong to the named method
            SparseConfig(method=method).with_overrides(None, params)
        # and when a value is invalid (each method parameter against every method that has it)
        _check_values(params)
        self._enabled = enabled
        self._method = method
        # hashable values: the resolved configuration is cached per region
        self._params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
        if "site_params" in params:
            self._params["site_params"] = normalize_site_params(params["site_params"], "sparsity(site_params=...)")
        self._entered: list[tuple[contextvars.Token, RegionState]] = []

    def _state(self, outer: RegionState) -> RegionState:
        merged = dict(outer.params)
        if self._method is not None and self._method != outer.method:
            # another method: the outer block's method parameters (per site too) no longer apply, its general ones do
            merged = {k: v for k, v in merged.items() if k in SparseConfig.field_names() and k != "site_params"}
        merged.update(self._params)
        return RegionState(
            enabled=self._enabled if self._enabled is not None else outer.enabled,
            method=self._method if self._method is not None else outer.method,
            params=tuple(sorted(merged.items(), key=lambda item: item[0])),
        )

    def __enter__(self) -> "sparsity":
        state = self._state(_REGION.get())
        self._entered.append((_REGION.set(state), state))
        return self

    def __exit__(self, *exc) -> None:
        token, state = self._entered[-1]
        if _REGION.get() is not state:
            raise RuntimeError(f"{self!r} exited while an inner sparsity region is still active: leave regions in "
                               "the reverse order of entering them (use `with`)")
        self._entered.pop()
        _REGION.reset(token)

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with sparsity(self._enabled, self._method, **self._params):
                return fn(*args, **kwargs)

        return wrapped

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self._params.items())
        return f"sparsity(enabled={self._enabled}, method={self._method!r}{extra})"


def _check_method_value(owner: str, key: str, value: Any) -> None:
    """``value`` alone is valid for parameter ``key`` of every method that has it (its range, NaN refused): a bad
    value fails where it is given, not at every call inside the region. Rules between parameters (a segment a
    multiple of the block) are checked when the region meets its configuration."""
    for spec in registered_methods().values():
        if key in spec.params.field_names():
            try:
                spec.params.check_value(key, value)
            except ValueError as exc:
                raise ValueError(f"{owner}: {exc}") from None


def _check_values(params: dict) -> None:
    own = {k: v for k, v in params.items() if k in SparseConfig.field_names() and k != "site_params"}
    if own:
        SparseConfig().with_overrides(None, own)
    for key, value in params.items():
        if key not in SparseConfig.field_names():
            _check_method_value(f"sparsity({key}=...)", key, value)
    # per-site parameters: each must belong to some method, and its value be valid there
    valid = _valid_param_names() - set(SparseConfig.field_names())
    for site, overrides in normalize_site_params(params.get("site_params"), "sparsity(site_params=...)"):
        unknown = sorted(set(dict(overrides)) - valid)
        if unknown:
            raise ValueError(f"sparsity(site_params=...)[{site!r}]: unknown parameter(s) {unknown}; valid: "
                             f"{sorted(valid)}")
        for key, value in overrides:
            _check_method_value(f"sparsity(site_params=...)[{site!r}]", key, value)


@functools.lru_cache(maxsize=256)
def _resolve_cached(config: SparseConfig, region: RegionState) -> SparseConfig:
    return region.apply(config)


def resolve(config: SparseConfig) -> SparseConfig:
    """The configuration in force here: ``config`` with the innermost ``sparsity`` block applied."""
    return _resolve_cached(config, _REGION.get())
