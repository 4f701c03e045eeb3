"""Never slower than dense: predict, before planning, whether a call's sparse path would beat dense attention.

A sparse call costs its selection plus its kernel on the kept tiles; dense costs cuDNN's causal SDPA. Per GPU
architecture and per plan shape (tile sizes, permuted keys or queries, early stop, P.V skip), the table
``breakeven_tables.json`` holds two measured numbers per sequence length (``benchmarks/bench_breakeven.py``):

* ``kernel``: the sparse kernel's time with every causal tile kept, over cuDNN's dense time;
* ``select``: the selection (plan building) time over cuDNN's dense time.

With density rho (the fraction of causal tiles the plan keeps, or visits under early stop), the sparse path costs
``select + rho * kernel`` of dense. It runs only where it is predicted at least ``MARGIN`` faster, below the
break-even density ``(1 - MARGIN - select) / kernel``: the table's ratios move by a few percent from run to run
(clocks, cuDNN's own spread), and a plan predicted to tie with dense measured up to 3% slower.

The density is only known after planning, and planning is what a dense call must not pay. So each site keeps the
density of its last plan at that length, read back without draining the GPU queue (a non-blocking copy, picked
up by a later call once it has landed). A site whose last plan was denser than break-even runs dense directly.
So that the decision follows the inputs, a dense site plans again after ``PROBE_EVERY`` dense calls, then after
twice as many each time the new plan is still too dense (up to ``PROBE_MAX``); such a re-plan runs dense too,
but where the plan's cost is only known by running it (early stop) the call runs its plan, whole (the shapes its
kernels already ran: a part of the call would compile new ones inside it). Where break-even lies below the lowest
density
any plan of the shape can have (one tile per query block), the call runs dense without planning at all. A site
without history plans and runs sparse. Devices or plan shapes without a table keep the configured method (CPU
tests, other GPUs).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .plan import causal_tile_count
from .rules import prefill_length
from .state import STATE, BoundedLRU, Lock

__all__ = ["Advice", "advise", "plan_shape", "break_even_density", "lowest_density", "has_table", "DensityHistory",
           "device_keys", "table_key", "HISTORY", "MARGIN", "PROBE_EVERY", "PROBE_MAX", "HISTORY_ENTRIES",
           "HISTORY_CONFIGS", "load_tables"]

MARGIN = 0.05  # the predicted gain the sparse path needs (BFLA / SpargeAttn at 128K, density 1: 1.02-1.03x)
PROBE_EVERY = 16  # dense calls before the first re-plan at a site that runs dense
PROBE_MAX = 256  # the interval doubles while re-plans stay too dense, up to this
# DensityHistory's bounds: (site, configuration, batch, heads, length bucket) entries, and configurations (regions
# switching density make one each); ~200 bytes an entry
HISTORY_ENTRIES = 4096
HISTORY_CONFIGS = 256
TABLE_FILE = Path(__file__).with_name("breakeven_tables.json")


def plan_shape(plan, select: Optional[str] = None) -> str:
    """The kernel-visible shape of a plan, the key of the break-even table: ``128x64+keys+stop``; with ``select``
    (the select stage that made it) ``128x128@<select>``, for selectors whose cost is their own: the table's entry
    under that key wins over the plain shape's."""
    parts = [f"{plan.block_m}x{plan.block_n}"]
    if plan.key_index is not None:
        parts.append("keys")
    if plan.query_index is not None:
        parts.append("queries")
    if plan.early_stop > 0:
        parts.append("stop")
    if plan.pv_skip is not None:
        parts.append("pvskip")
    return "+".join(parts) + (f"@{select}" if select else "")


@STATE.cached("breakeven.lowest_density", 1024)
def lowest_density(shape: str, num_queries: int, num_keys: int) -> float:
    """The least density a plan of ``shape`` can have: every query block keeps at least one tile."""
    block_m, block_n = (int(side) for side in shape.split("@")[0].split("+")[0].split("x"))
    return -(-num_queries // block_m) / max(causal_tile_count(num_queries, num_keys, block_m, block_n), 1)


_TABLES = STATE.value("breakeven.tables")  # the table file, read once


def load_tables() -> dict:
    """{architecture: {plan shape: {length: {"kernel": ..., "select": ...}}}} from ``breakeven_tables.json``."""
    if _TABLES.value is None:
        _TABLES.value = json.loads(TABLE_FILE.read_text()) if TABLE_FILE.exists() else {}
    return _TABLES.value


def architecture(device: torch.device) -> str:
    """The table's key for ``device``: the GPU's own entry where one was measured (``sm_90:NVIDIA H200``), else its
    architecture's (``sm_90``, measured on an H100), the device type otherwise (no table there)."""
    return table_key(device_keys(device), load_tables())


def table_key(keys: tuple, tables: dict) -> str:
    """Of (a GPU's own key, its architecture's key), the one ``tables`` holds an entry for, the GPU's own first;
    the architecture's where neither has one (no table: the method runs as configured)."""
    own, shared = keys
    return own if own in tables else shared


def device_keys(device: torch.device) -> tuple:
    """(this GPU's own table key, its architecture's key): GPUs of one compute capability differ in memory bandwidth
    and clocks (an H200 against an H100), so each may carry its own break-even points."""
    return _device_keys(device.type, device.index)


@STATE.cached("breakeven.device_keys", None)  # one per device
def _device_keys(kind: str, index: Optional[int]) -> tuple:  # a driver query: once per device, not per call
    if kind != "cuda":
        return kind, kind
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}:{torch.cuda.get_device_name(index)}", f"sm_{major}{minor}"


def has_table(device: torch.device) -> bool:
    return bool(load_tables().get(architecture(device)))


def break_even_density(device: torch.device, shape: str, num_keys: int) -> Optional[float]:
    """The density below which the sparse path beats dense for this plan shape and length, or None (no table).

    Between measured lengths the two ratios are interpolated in log2(length); outside, the nearest is used.
    """
    return _break_even(architecture(device), shape, num_keys, id(load_tables()))


@STATE.cached("breakeven.break_even", 1024)
def _break_even(arch: str, shape: str, num_keys: int, tables_id: int) -> Optional[float]:
    tables = load_tables().get(arch, {})
    table = tables.get(shape) or tables.get(shape.split("@")[0])  # the selector's own entry, else the shape's
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
    return max(0.0, (1.0 - MARGIN - entry["select"]) / entry["kernel"])


@dataclass
class _Entry:
    density: Optional[float] = None  # the last plan's density that has landed on the host
    pending: Optional[tuple] = None  # (host tensor, event) of a plan's density still on its way
    shape: Optional[str] = None
    dense_calls: int = 0  # dense calls since the last plan
    interval: int = PROBE_EVERY  # dense calls before the next re-plan


class DensityHistory:
    """Per (site, configuration, length bucket): the density of the last plan, read back without a sync."""

    def __init__(self, max_entries: int = HISTORY_ENTRIES, max_configs: int = HISTORY_CONFIGS) -> None:
        if max_entries < 1 or max_configs < 1:
            raise ValueError(f"DensityHistory: max_entries and max_configs must be >= 1, got {max_entries}, "
                             f"{max_configs}")
        self.max_entries, self.max_configs = max_entries, max_configs
        self._lock = Lock()
        # keys hold batch sizes and region configurations, as many as the inputs have
        self._entries = BoundedLRU(max_entries)
        self._shapes = BoundedLRU(max_configs)  # configuration -> the shape of its last plan (every site's)

    def __len__(self) -> int:
        return len(self._entries)

    def configs_held(self) -> int:
        return len(self._shapes)

    def _entry(self, key, create: bool) -> Optional["_Entry"]:
        """The entry at ``key``, now the most recently used (created if ``create``; the least recently used one
        dropped past ``max_entries``: that site and length plans again on its next call). Under the lock."""
        entry = self._entries.get(key)
        if entry is None and create:
            entry = _Entry()
            self._entries.put(key, entry)
        return entry

    @staticmethod
    def key(site: str, config, q_shape: torch.Size, k_shape: torch.Size) -> tuple:
        # lengths within a factor of two share a history (one prompt length varies from call to call)
        return site, config, q_shape[0], q_shape[1], k_shape[1], int(math.log2(max(k_shape[-2], 1)))

    def prediction(self, key) -> Optional[tuple[float, str]]:
        """(density, plan shape) of the last plan at ``key`` once known, else None."""
        with self._lock:
            entry = self._entry(key, create=False)
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

    def shape_of(self, config) -> Optional[str]:
        """The plan shape ``config`` produced last anywhere, before this site has planned itself."""
        with self._lock:
            return self._shapes.peek(config)  # read only: recency is what record() sets

    def should_probe(self, key) -> bool:
        """Count one more dense call at ``key``; True when it is time to plan again (the next wait doubles)."""
        with self._lock:
            entry = self._entry(key, create=True)
            entry.dense_calls += 1
            if entry.dense_calls < entry.interval:
                return False
            entry.interval = min(2 * entry.interval, PROBE_MAX)
            return True

    def went_sparse(self, key) -> None:
        """The last plan at ``key`` was sparse enough: re-plan soon again if the site turns dense."""
        with self._lock:
            entry = self._entry(key, create=False)
            if entry is not None:
                entry.interval = PROBE_EVERY

    def remember(self, key, plan, config, num_queries: int, num_keys: int,
                 visited: Optional[torch.Tensor] = None) -> None:
        """Remember ``plan``'s density at ``key``: the share of the causal tiles it visited (``visited``, counted by
        running it: early stop) or else lists, without waiting for it."""
        shape = plan_shape(plan, config.select_stage)
        self.record(key, _plan_density(plan, num_queries, num_keys, visited), shape, config)

    def record(self, key, density: torch.Tensor, shape: str, config=None) -> None:
        """Remember a plan's density (a 0-d tensor, on any device) without waiting for it."""
        if density.is_cuda:
            host = torch.empty((), dtype=density.dtype, pin_memory=True)
            host.copy_(density, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = density, None
        with self._lock:
            entry = self._entry(key, create=True)
            entry.pending, entry.shape, entry.dense_calls = (host, event), shape, 0
            if config is not None:
                self._shapes.put(config, shape)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._shapes.clear()


def _plan_density(plan, num_queries: int, num_keys: int, visited: Optional[torch.Tensor]) -> torch.Tensor:
    """0-d, on the plan's device (no sync): the share of the causal tiles visited, else listed."""
    if visited is None:
        return plan.density(num_queries, num_keys).mean()
    total = causal_tile_count(num_queries, num_keys, plan.block_m, plan.block_n) * visited[:, :, 0].numel()
    return visited.sum(dtype=torch.float32) / max(total, 1)


HISTORY = STATE.add("breakeven.history", DensityHistory(), bound=HISTORY_ENTRIES)
STATE.add("breakeven.history_configurations", HISTORY._shapes, bound=HISTORY_CONFIGS, clear=HISTORY.clear)
STATE.lock("breakeven.history_lock", HISTORY._lock)


@dataclass(frozen=True)
class Advice:
    """What break-even says of one call before planning.

    ``dense_reason``: why the call should run dense (None: plan and run the method); ``history_key``: where the
    plan's density is remembered when the decision depends on history (None: it does not); ``replan``: plan again
    although the call runs dense, so that the next call decides on a fresh density."""

    dense_reason: Optional[str] = None
    history_key: Optional[tuple] = None
    replan: bool = False


def advise(q_shape: torch.Size, k_shape: torch.Size, device: torch.device, config, site: str) -> Advice:
    """Break-even's advice for one call at ``site`` of queries and keys of these shapes on ``device``
    (``config.dense_when_faster``; module docstring)."""
    if not config.dense_when_faster or not has_table(device):
        return Advice()  # no measured table for this device: the configured method runs
    num_queries, num_keys = q_shape[-2], k_shape[-2]
    key = HISTORY.key(site, config, q_shape, k_shape)
    predicted = HISTORY.prediction(key)
    shape = predicted[1] if predicted is not None else HISTORY.shape_of(config)
    limit = None if shape is None else break_even_density(device, shape, prefill_length(num_queries, num_keys))
    if limit is not None:
        lowest = lowest_density(shape, num_queries, num_keys)
        if limit < lowest:  # no plan can win at this length: do not even plan
            return Advice(f"break-even density {limit:.2f} is below the least any {shape} plan keeps at {num_keys} "
                          f"keys ({lowest:.2f})")
    if predicted is None or limit is None:
        return Advice(history_key=key)
    density = predicted[0]
    if density <= limit:
        HISTORY.went_sparse(key)
        return Advice(history_key=key)
    reason = f"plan density {density:.2f} above break-even {limit:.2f} (this site's last plan, {shape} tiles)"
    return Advice(reason, key, HISTORY.should_probe(key))
