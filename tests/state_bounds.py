"""Every cache and registry the package keeps across calls, with its size and its bound (docs/design.md, "State
kept across calls"): what the soak and fault tests check."""

from __future__ import annotations


def _lru(fn, bound=None) -> tuple[int, int]:
    info = fn.cache_info()
    return info.currsize, info.maxsize if info.maxsize is not None else bound


def cache_sizes() -> dict[str, tuple[int, int]]:
    """name -> (entries now, bound)."""
    from sparse_compile import api, backend, breakeven, config, context, padding, plan, report, rules, site
    from sparse_compile import transformers_attention as front_door
    from sparse_compile.methods import s2o

    reasons = max((sum(p == path for p, _ in e.calls) for e in report.runtime_stats().values() for path, _ in e.calls),
                  default=0)
    sizes = {
        # and one "other reasons" row past the cap
        "report runtime_stats reasons per site and path": (reasons, report.MAX_REASONS_PER_PATH + 1),
        "breakeven.HISTORY entries": (len(breakeven.HISTORY), breakeven.HISTORY.max_entries),
        "breakeven.HISTORY configurations": (breakeven.HISTORY.configs_held(), breakeven.HISTORY.max_configs),
        "breakeven.lowest_density": _lru(breakeven.lowest_density),
        "breakeven._break_even": _lru(breakeven._break_even),
        "breakeven._device_keys (per device)": _lru(breakeven._device_keys, 64),
        "context._resolve_cached": _lru(context._resolve_cached),
        "config._from_json": _lru(config._from_json),
        "config._at_site": _lru(config._at_site),
        "site._from_json": _lru(site._from_json),
        "rules.layer_index": _lru(rules.layer_index),
        "plan.causal_tile_count": _lru(plan.causal_tile_count),
        "s2o._s2o_width": _lru(s2o._s2o_width),
        "s2o._window_tables": _lru(s2o._window_tables),
        "api._PRECOMPILED": (len(api._PRECOMPILED), api.PRECOMPILED_ENTRIES),
        "backend._WARNED": (len(backend._WARNED), backend.WARNED_FRAMES),
        # weakly held: entries live as long as the tensors and models they describe
        "padding._OWNED (live masks)": (len(padding._OWNED), 64),
        "transformers_attention._NOTES (live masks)": (len(front_door._NOTES), 64),
        "transformers_attention._entry (two functions)": _lru(front_door._entry, 2),
        "context._OPEN_IN_THREADS (threads inside a region)": (len(context._OPEN_IN_THREADS), 64),
    }
    try:
        from sparse_compile.kernels import common
    except ImportError:  # no Triton
        return sizes
    sizes["kernels.common.plan_buckets"] = _lru(common.plan_buckets)
    return sizes
