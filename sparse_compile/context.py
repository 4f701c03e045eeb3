"""``sparsity(...)``: change what compiled code does inside a ``with`` block, at run time, without recompiling.

The state lives in a ``contextvars.ContextVar``: each thread and each asyncio task sees its own, nesting is a
stack of tokens, and leaving a block restores the previous state exactly (even on exceptions).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .config import SparseConfig, normalize_site_params
from .registry import registered_methods
from .state import STATE

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
# the blocks entered in this context, innermost last: (block, its token, the state it set). Held per context, not
# per block object, so one block object entered by two threads or asyncio tasks keeps their entries apart
_ENTERED: contextvars.ContextVar[tuple] = contextvars.ContextVar("sparse_compile_entered", default=())
# thread id -> regions open in it: a call in a thread with none, while another thread has one open, is most likely
# work that a server or an executor handed to its own thread, where the caller's region does not reach
_OPEN_IN_THREADS: dict[int, int] = STATE.add("context.open_in_threads", {})


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
        _warn_if_inside_compiled_code()
        state = self._state(_REGION.get())
        token = _REGION.set(state)
        _ENTERED.set(_ENTERED.get() + ((self, token, state),))
        thread = threading.get_ident()
        _OPEN_IN_THREADS[thread] = _OPEN_IN_THREADS.get(thread, 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        entered = _ENTERED.get()
        if not any(block is self for block, _, _ in entered):
            raise RuntimeError(f"{self!r} exited in a thread or task that did not enter it")
        block, token, state = entered[-1]
        if block is not self or _REGION.get() is not state:
            raise RuntimeError(f"{self!r} exited while an inner sparsity region is still active: leave regions in "
                               "the reverse order of entering them (use `with`)")
        _ENTERED.set(entered[:-1])
        _REGION.reset(token)
        thread = threading.get_ident()
        left = _OPEN_IN_THREADS.get(thread, 1) - 1
        if left > 0:
            _OPEN_IN_THREADS[thread] = left
        else:
            _OPEN_IN_THREADS.pop(thread, None)

    def __call__(self, fn):
        """``fn`` with this region in force while its body runs: a function, a coroutine function (the region
        spans its awaits), a generator or an async generator function (the region is in force while the body runs
        between yields, not in the caller's code between them)."""
        def region() -> "sparsity":
            return sparsity(self._enabled, self._method, **self._params)

        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def wrapped_async_gen(*args, **kwargs):
                agen = fn(*args, **kwargs)
                step, value = agen.asend, None
                try:
                    while True:
                        with region():
                            try:
                                out = await step(value)
                            except StopAsyncIteration:
                                return
                        try:
                            value, step = (yield out), agen.asend
                        except GeneratorExit:
                            raise
                        except BaseException as exc:  # thrown in by the caller: into the body, under the region
                            value, step = exc, agen.athrow
                finally:
                    with region():
                        await agen.aclose()

            return wrapped_async_gen
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def wrapped_gen(*args, **kwargs):
                gen = fn(*args, **kwargs)
                step, value = gen.send, None
                try:
                    while True:
                        with region():
                            try:
                                out = step(value)
                            except StopIteration as stop:
                                return stop.value
                        try:
                            value, step = (yield out), gen.send
                        except GeneratorExit:
                            raise
                        except BaseException as exc:  # thrown in by the caller: into the body, under the region
                            value, step = exc, gen.throw
                finally:
                    with region():
                        gen.close()

            return wrapped_gen
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def wrapped_coroutine(*args, **kwargs):
                with region():
                    return await fn(*args, **kwargs)

            return wrapped_coroutine

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with region():
                return fn(*args, **kwargs)

        return wrapped

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self._params.items())
        return f"sparsity(enabled={self._enabled}, method={self._method!r}{extra})"


def _warn_if_inside_compiled_code() -> None:
    """A block entered in a function that torch.compile compiles is code Dynamo cannot trace: it runs that function
    eagerly (plain dense attention, nothing in ``runtime_stats()``). Say so where it happens: this frame is never
    traced (disabled, not recursively), so it runs with Dynamo's frame callback still in force."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    if get_eval_frame_callback() not in (None, False):
        warnings.warn("sparse_compile.sparsity(...) entered inside a function compiled by torch.compile: Dynamo "
                      "cannot trace the block, so that function runs eagerly (plain dense attention, not counted in "
                      "runtime_stats()). Enter the block around the call of the compiled function instead.",
                      UserWarning, stacklevel=3)


_warn_if_inside_compiled_code = torch.compiler.disable(_warn_if_inside_compiled_code, recursive=False)


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


@STATE.cached("context.resolve", 256)
def _resolve_cached(config: SparseConfig, region: RegionState) -> SparseConfig:
    return region.apply(config)


def resolve(config: SparseConfig) -> SparseConfig:
    """The configuration in force here: ``config`` with the innermost ``sparsity`` block applied."""
    region = _REGION.get()
    if _OPEN_IN_THREADS and region is _NO_REGION and threading.get_ident() not in _OPEN_IN_THREADS:
        _warn_region_elsewhere()
    return _resolve_cached(config, region)


_NO_REGION = _REGION.get()


def _warn_region_elsewhere() -> None:
    warnings.warn("sparse_compile: attention runs in a thread where no sparsity(...) region is open while another "
                  "thread has one: regions are per thread (and asyncio task), so work that continuous batching, a "
                  "server or an executor runs in its own thread does not see the caller's region. Configure the "
                  "model instead (compile options, enable_transformers_attention(model, config)), or run the work "
                  "in contextvars.copy_context().run", UserWarning, stacklevel=3)
