"""Never slower than dense: predict, before planning, whether a call's sparse path would beat dense attention.

A sparse call costs its selection plus its kernel on the kept tiles; dense costs cuDNN's causal SDPA. Per GPU
architecture and per plan shape (tile sizes, permuted keys or queries, early stop, P.V skip), the table
``breakeven_tables.json`` holds two measured numbers per sequence length (``benchmarks/bench_breakeven.py``):

* ``kernel``: the sparse kernel's time with every causal tile kept, over cuDNN's dense time;
* ``select``: the selection (plan building) time over cuDNN's dense time.

With density rho (the fraction of causal tiles the plan keeps, or visits under early stop), the sparse path costs
``select + rho * kernel`` of dense, so it wins below the break-even density ``(1 - select) / kernel``.

The density is only known after planning, and planning is what a dense call must not pay. So each site keeps the
density of its last plan at that length, read back without draining the GPU queue (a non-blocking copy, picked
up by a later call once it has landed). A site whose last plan was denser than break-even runs dense directly;
every ``PROBE_EVERY``-th call there plans again so that the decision follows the inputs. A site without history
plans and runs sparse. Devices or plan shapes without a table keep the configured method (CPU tests, other GPUs).
"""

from __future__ import annotations

import functools
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

__all__ = ["plan_shape", "break_even_density", "has_table", "DensityHistory", "HISTORY", "PROBE_EVERY",
           "load_tables"]

PROBE_EVERY = 16  # calls between re-plans at a site that runs dense
TABLE_FILE = Path(__file__).with_name("breakeven_tables.json")


def plan_shape(plan) -> str:
    """The kernel-visible shape of a plan, the key of the break-even table: ``128x64+keys+stop``."""
    parts = [f"{plan.block_m}x{plan.block_n}"]
    if plan.key_index is not None:
        parts.append("keys")
    if plan.query_index is not None:
        parts.append("queries")
    if plan.early_stop > 0:
        parts.append("stop")
    if plan.pv_skip is not None:
        parts.append("pvskip")
    return "+".join(parts)


_TABLES: Optional[dict] = None


def load_tables() -> dict:
    """{architecture: {plan shape: {length: {"kernel": ..., "select": ...}}}} from ``breakeven_tables.json``."""
    global _TABLES
    if _TABLES is None:
        _TABLES = json.loads(TABLE_FILE.read_text()) if TABLE_FILE.exists() else {}
    return _TABLES


def architecture(device: torch.device) -> str:
    """The table's key for ``device``: ``sm_90`` for an H100, the device type otherwise (no table there)."""
    return _architecture(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _architecture(kind: str, index: Optional[int]) -> str:  # a driver query: once per device, not per call
    if kind != "cuda":
        return kind
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def has_table(device: torch.device) -> bool:
    return bool(load_tables().get(architecture(device)))


def break_even_density(device: torch.device, shape: str, num_keys: int) -> Optional[float]:
    """The density below which the sparse path beats dense for this plan shape and length, or None (no table).

    Between measured lengths the two ratios are interpolated in log2(length); outside, the nearest is used.
    """
    return _break_even(architecture(device), shape, num_keys, id(load_tables()))


@functools.lru_cache(maxsize=1024)
def _break_even(arch: str, shape: str, num_keys: int, tables_id: int) -> Optional[float]:
    table = load_tables().get(arch, {}).get(shape)
    if not table:
        return None
    points = sorted((int(n), entry) for n, entry in table.items())
    x = math.log2(max(num_keys, 1))
    if x <= math.log2(points[0][0]):
        entry = points[0][1]
    elif x >= math.log2(points[-1][0]):
        entry = points[-1][1]
    else:
        for (n0, e0), (n1, e1) in zip(points, points[1:]):
            if math.log2(n0) <= x <= math.log2(n1):
                t = (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
                entry = {k: e0[k] + t * (e1[k] - e0[k]) for k in ("kernel", "select")}
                break
    return max(0.0, (1.0 - entry["select"]) / entry["kernel"])


@dataclass
class _Entry:
    density: Optional[float] = None  # the last plan's density that has landed on the host
    pending: Optional[tuple] = None  # (host tensor, event) of a plan's density still on its way
    shape: Optional[str] = None
    dense_calls: int = 0  # consecutive calls that ran dense on this history


class DensityHistory:
    """Per (site, configuration, length bucket): the density of the last plan, read back without a sync."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict = {}

    @staticmethod
    def key(site: str, config, q: torch.Tensor, k: torch.Tensor) -> tuple:
        # lengths within a factor of two share a history (one prompt length varies from call to call)
        return site, config, q.shape[0], q.shape[1], k.shape[1], int(math.log2(max(k.shape[-2], 1)))

    def prediction(self, key) -> Optional[tuple[float, str]]:
        """(density, plan shape) of the last plan at ``key`` once known, else None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.pending is not None:
                host, event = entry.pending
                if event is None or event.query():
                    entry.density = float(host.item())
                    entry.pending = None
            if entry.density is None:
                return None
            return entry.density, entry.shape

    def should_probe(self, key) -> bool:
        """Count one more dense call at ``key``; True every PROBE_EVERY-th time: plan again."""
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            entry.dense_calls += 1
            return entry.dense_calls % PROBE_EVERY == 0

    def record(self, key, density: torch.Tensor, shape: str) -> None:
        """Remember a plan's density (a 0-d tensor, on any device) without waiting for it."""
        if density.is_cuda:
            host = torch.empty((), dtype=density.dtype, pin_memory=True)
            host.copy_(density, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = density, None
        with self._lock:
            entry = self._entries.setdefault(key, _Entry())
            entry.pending, entry.shape, entry.dense_calls = (host, event), shape, 0

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


HISTORY = DensityHistory()
