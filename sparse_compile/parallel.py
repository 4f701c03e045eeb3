"""Beyond one device: tensor parallelism (attention heads sharded) and Ulysses sequence parallelism.

Tensor parallelism. A model parallelised with ``parallelize_module`` whose attention sees plain local tensors
(``ColwiseParallel``/``RowwiseParallel`` with their default ``use_local_output=True``) needs nothing: each rank's
op runs its local query and key/value heads. When attention sees DTensors, DTensor asks the op for its sharding
rule, registered here (``register_dtensor_sharding``, done by the rewrite whenever DTensor is loaded): q, k, v and
the output sharded alike on the head dim (or the batch dim, or all replicated), the key-padding mask replicated
(sharded with the batch) and the query positions replicated. No Q/K/V is gathered. Heads must divide by the ranks
sharing them, so that every rank keeps whole GQA groups.

Sequence parallelism (DeepSpeed-Ulysses). Inside ``with sequence_parallel(group):`` every rewritten attention
treats its q, k, v as this rank's contiguous chunk of one sequence (chunks in rank order), exchanges sequence for
heads with one all-to-all for Q, K and V together (``(B, H, n, D)`` -> ``(B, H/P, N, D)``), runs the sparse
method on whole sequences for its ``H/P`` heads, and exchanges back. Exact with respect to one device: each
head's attention is computed whole, by one rank. Before any data moves the ranks exchange their shapes (a few
integers), so that a mistake (unequal batches, a decode step on one rank) raises the same error everywhere
rather than leaving ranks waiting in a collective; it also lets chunk lengths differ between ranks.
``ulysses_attention`` is the same for models that call attention themselves.
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .config import SparseConfig
from .padding import check_query_positions
from .pipeline import attend_eager
from .rules import SUPPORTED_DTYPES, validate_qkv
from .site import SiteSpec
from .state import STATE

__all__ = ["sequence_parallel", "ulysses_attention", "register_dtensor_sharding", "is_dtensor",
           "active_sequence_group", "run_sequence_parallel", "refuse_plain_sdpa_under_sequence_parallel"]

_SEQUENCE_GROUP: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar(
    "sparse_compile_sequence_parallel", default=None
)


def _check_whole_groups(q_heads: int, kv_heads: int, parts: int, who: str) -> None:
    """Each of ``parts`` ranks must hold the same number of whole GQA groups (query heads with their K/V head)."""
    if q_heads % parts or kv_heads % parts:
        raise ValueError(
            f"{who}: query heads ({q_heads}) and key/value heads ({kv_heads}) must both be divisible by the "
            f"{parts} ranks sharing them, so that every rank holds whole GQA groups"
        )


def _process_group(group, who: str):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who}: torch.distributed is not initialised; call dist.init_process_group first")
    return dist.group.WORLD if group is None else group


# -- sequence parallelism ---------------------------------------------------------------------------------------
class sequence_parallel:
    """Context manager: rewritten attention inside it runs Ulysses sequence parallelism over ``group``.

    Every rank of ``group`` (default: the whole world) calls the compiled model on its chunk of the prompt
    (chunks in rank order) with the chunk's global positions (``position_ids``) and its slice of the
    ``attention_mask`` if any; attention then sees the whole prompt. Acts at run time, like ``sparsity``: no
    recompilation, and outside the block the same compiled model runs on one device.

    Every attention must be rewritten: a graph compiled by ``sparse_prefill`` that left a site as plain SDPA
    (``skip_layers``, an unproven mask, a decode step; see ``explain``) raises inside the block, on every rank,
    since that site would attend within the chunk alone. So does a site whose ``attn_mask`` is a graph input
    checked at run time (``runtime_mask.py``): each rank's mask covers its own chunk only. Ranks must run the same
    graphs (same model, same compile settings), so every rank raises the same error before any collective.
    """

    def __init__(self, group=None) -> None:
        self.group = _process_group(group, "sequence_parallel")
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> "sequence_parallel":
        self._tokens.append(_SEQUENCE_GROUP.set(self.group))
        return self

    def __exit__(self, *exc) -> None:
        _SEQUENCE_GROUP.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"sequence_parallel(world_size={dist.get_world_size(self.group)})"


def active_sequence_group():
    """The process group of the innermost ``sequence_parallel`` block, or None."""
    return _SEQUENCE_GROUP.get()


# Before any data moves, every rank posts a header: its shapes, whether it has a padding mask, and a refusal code.
# Every rank then checks the same table, so bad input raises the same error on all ranks instead of leaving some
# waiting in a collective; the chunk lengths in it also let chunks differ in length.
_SHAPE_FIELDS = ("batch", "query heads", "key/value heads", "head dim", "value head dim", "q_len", "kv_len", "v_len")
_HAS_PADDING, _REFUSAL = len(_SHAPE_FIELDS), len(_SHAPE_FIELDS) + 1
_REFUSALS = {
    1: "its query positions (cache_position) are not the canonical arange the rewrite proved the mask for",
    2: "its compiled graph left attention as plain SDPA",
}


def _exchange_headers(header: Tensor, group) -> list[list[int]]:
    world = dist.get_world_size(group)
    table = header.new_empty(world * header.numel())  # gathered along dim 0, rank after rank
    dist.all_gather_into_tensor(table, header, group=group)
    return table.view(world, -1).tolist()


def _raise_refusals(who: str, rows: list[list[int]], own_problem: Optional[str]) -> None:
    refused = {rank: row[_REFUSAL] for rank, row in enumerate(rows) if row[_REFUSAL]}
    if refused:
        summary = "; ".join(f"rank {rank}: {_REFUSALS[code]}" for rank, code in refused.items())
        raise RuntimeError(f"{who}: refused on {summary}" + (f"\nthis rank: {own_problem}" if own_problem else ""))


def refuse_plain_sdpa_under_sequence_parallel(sites: str, args: tuple, kwargs: dict) -> None:
    """A compiled graph that kept attention as plain SDPA at ``sites``, called with ``args`` / ``kwargs``: inside
    ``sequence_parallel`` those sites would silently attend within this rank's chunk only, so raise there. The
    other ranks, if their graphs were rewritten, wait in their first attention's header exchange: post a refusal
    there so that they raise too."""
    group = _SEQUENCE_GROUP.get()
    if group is None:
        return
    problem = (f"this compiled graph left attention as plain SDPA ({sites}); on a chunk of the sequence it "
               "would attend within the chunk only. Every attention must be rewritten (no skip_layers, "
               "proven masks, prefill only: see sparse_compile.explain); run anything else outside "
               "sequence_parallel")
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))  # boxed calls pass one list of inputs
    device = next((leaf.device for leaf in leaves if isinstance(leaf, Tensor)), torch.device("cpu"))
    header = torch.zeros(len(_SHAPE_FIELDS) + 2, dtype=torch.int64, device=device)
    header[_REFUSAL] = 2
    _raise_refusals("sequence_parallel", _exchange_headers(header, group), problem)


@dataclass(frozen=True)
class _Chunks:
    """What every rank of the group holds, as agreed by the header exchange."""

    world: int
    lengths: tuple[int, ...]  # each rank's chunk length, in rank order
    any_padding: bool  # some rank's call has a key-padding mask


def _agree(who: str, group, q: Tensor, k: Tensor, v: Tensor, key_padding: Optional[Tensor] = None,
           positions_problem: Optional[str] = None) -> _Chunks:
    """Exchange headers, then check the table (the same on every rank) before any data moves."""
    world = dist.get_world_size(group)
    local = (*q.shape[:2], k.shape[1], q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2], v.shape[-2])
    refusal = 1 if positions_problem else 0
    rows = _exchange_headers(torch.tensor([*local, key_padding is not None, refusal], device=q.device), group)
    _raise_refusals(who, rows, positions_problem)
    for index, name in enumerate(_SHAPE_FIELDS[:5]):
        values = [row[index] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"{who}: every rank must hold the same {name}; per rank: {values}")
    if not all(row[5] == row[6] == row[7] for row in rows):
        raise ValueError(
            f"{who}: q_len, kv_len per rank {[tuple(row[5:8]) for row in rows]}: sequence parallelism runs prefills "
            "without a cached prefix (run decode steps and chunked prefill outside sequence_parallel)"
        )
    if q.shape[-1] != v.shape[-1]:
        raise ValueError(f"{who}: q and v head dims differ ({q.shape[-1]}, {v.shape[-1]})")
    _check_whole_groups(q.shape[1], k.shape[1], world, who)
    return _Chunks(world, tuple(row[5] for row in rows), any(row[_HAS_PADDING] for row in rows))


def _sequence_to_heads(tensors: tuple[Tensor, ...], group, chunks: _Chunks) -> list[Tensor]:
    """(B, H_i, n, D) sequence chunks -> (B, H_i/P, N, D) head shares of whole sequences, in one all-to-all."""
    world = chunks.world
    batch, _, length, dim = tensors[0].shape
    shares = [t.shape[1] // world for t in tensors]
    # rank j is sent head share j of every tensor: (P, B, sum H_i/P, n, D), equal parts along dim 0 (one copy)
    send = tensors[0].new_empty((world, batch, sum(shares), length, dim))
    offset = 0
    for tensor, share in zip(tensors, shares):
        send[:, :, offset:offset + share] = tensor.reshape(batch, world, share, length, dim).transpose(0, 1)
        offset += share
    per_token = batch * send.shape[2] * dim
    received = send.new_empty(per_token * sum(chunks.lengths))
    dist.all_to_all_single(received, send.view(-1), [per_token * n for n in chunks.lengths], [send[0].numel()] * world,
                           group=group)
    # rank j's part is its chunk of this rank's heads: the chunks in rank order make the sequence
    parts = received.split([per_token * n for n in chunks.lengths])
    whole = torch.cat([part.view(batch, send.shape[2], n, dim) for part, n in zip(parts, chunks.lengths)], dim=2)
    return list(whole.split(shares, dim=1))


def _heads_to_sequence(out: Tensor, group, chunks: _Chunks, rank: int) -> Tensor:
    """(B, H/P, N, D) head share of whole sequences -> (B, H, n, D) this rank's chunk of every head."""
    world = chunks.world
    batch, share, _, dim = out.shape
    send, offset = out.new_empty(out.numel()), 0  # chunk j of the sequence to rank j, one after another
    for part in out.split(list(chunks.lengths), dim=2):
        send[offset:offset + part.numel()].view(part.shape).copy_(part)
        offset += part.numel()
    per_token = batch * share * dim
    length = chunks.lengths[rank]
    received = out.new_empty((world, batch, share, length, dim))
    dist.all_to_all_single(received.view(-1), send, [per_token * length] * world,
                           [per_token * n for n in chunks.lengths], group=group)
    return received.transpose(0, 1).reshape(batch, world * share, length, dim)  # rank j sent head share j


def _gather_padding(key_padding: Optional[Tensor], like: Tensor, group, chunks: _Chunks) -> Tensor:
    """Every rank's chunk of the key-padding mask -> the (B, N) mask of the whole sequence (all valid where a
    rank's call has none). float32 carries 0/1 and any other value the binary-padding check must see."""
    longest = max(chunks.lengths)
    batch, length = like.shape[0], like.shape[-2]
    local = like.new_ones((batch, longest), dtype=torch.float32)
    if key_padding is not None:
        local[:, :length] = key_padding.to(torch.float32)
    gathered = local.new_empty((chunks.world * batch, longest))  # gathered along dim 0, rank after rank
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.view(chunks.world, batch, longest)
    return torch.cat([gathered[rank, :, :n] for rank, n in enumerate(chunks.lengths)], dim=1)


def run_sequence_parallel(attention: Callable[..., Tensor], group, q: Tensor, k: Tensor, v: Tensor,
                          scale: Optional[float], site, key_padding: Optional[Tensor],
                          query_positions: Optional[Tensor]) -> Tensor:
    """The op's Ulysses path: ``attention(q, k, v, scale, site, key_padding, None)`` on whole sequences and this
    rank's share of the heads, between two all-to-alls (``site``: the op's ``SiteSpec``)."""
    problem = None
    if query_positions is not None:
        # the traced mask was proven for a prefill of the local chunk: hold the local positions to that
        try:
            check_query_positions(query_positions, q.shape[-2], k.shape[-2])
        except RuntimeError as exc:
            problem = str(exc)
    chunks = _agree("sequence_parallel", group, q, k, v, key_padding, problem)
    if chunks.world == 1:
        return attention(q, k, v, scale, site, key_padding, None)
    padding = None
    if chunks.any_padding:
        # the padding of the whole sequence (B, N): small next to Q/K/V; with q_len == kv_len the mask form of
        # the op (queries last) computes what is_causal does, so every rank takes it
        padding, site = _gather_padding(key_padding, q, group, chunks), site.replace(queries_last=True)
    q_heads, k_heads, v_heads = _sequence_to_heads((q, k, v), group, chunks)
    out = attention(q_heads, k_heads, v_heads, scale, site, padding, None)
    return _heads_to_sequence(out, group, chunks, dist.get_rank(group))


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, scale: Optional[float] = None,
                      config: Optional[SparseConfig] = None) -> Tensor:
    """``sparse_attention`` over a sequence sharded across ``group`` (default: the whole world), for code that
    calls attention itself.

    q ``(B, Hq, n, D)``, k and v ``(B, Hkv, n, D)``: this rank's chunk of the sequence (chunks in rank order;
    lengths may differ between ranks). Returns this rank's chunk of causal attention over the whole sequence,
    ``(B, Hq, n, D)``. Hq and Hkv must be divisible by the group size. Inference only.
    """
    validate_qkv(q, k, v, who="ulysses_attention", dtypes=SUPPORTED_DTYPES + (torch.float64,))
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"ulysses_attention: config must be a SparseConfig, got {type(config).__name__}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("ulysses_attention: inference only (the all-to-all has no backward); "
                           "call it under torch.no_grad()")
    group = _process_group(group, "ulysses_attention")
    chunks = _agree("ulysses_attention", group, q, k, v)
    if chunks.world == 1:
        return attend_eager(q, k, v, scale, config)
    q_heads, k_heads, v_heads = _sequence_to_heads((q, k, v), group, chunks)
    out = attend_eager(q_heads, k_heads, v_heads, scale, config)
    return _heads_to_sequence(out, group, chunks, dist.get_rank(group))


# -- tensor parallelism: the op's DTensor sharding rule ----------------------------------------------------------
_REGISTERED = STATE.value("parallel.registered", False)  # after a reset: registered again, torch's entry replaced
_REGISTER_LOCK = STATE.lock("parallel.register_lock")


def _head_shards(spec) -> int:
    """How many ways a DTensor spec splits dim 1 (heads) across its mesh; 0 when it does not shard heads."""
    from torch.distributed.tensor import Shard

    ways = 0
    for mesh_dim, placement in enumerate(spec.placements):
        if isinstance(placement, Shard) and placement.dim in (1, 1 - len(spec.shape)):
            ways = max(ways, 1) * spec.mesh.size(mesh_dim)
    return ways


def _causal_attention_sharding(q, k, v, scale, spec, key_padding=None, query_positions=None, runtime_mask=None):
    """Acceptable (output, inputs) placements per mesh dim; DTensor picks the one that moves the least data."""
    from torch.distributed.tensor import Replicate, Shard

    ways = max(_head_shards(q), _head_shards(k), _head_shards(v))
    if ways:
        # sharded heads that do not divide would put split GQA groups on a rank: refuse, do not gather
        site = SiteSpec.from_json(spec).site
        _check_whole_groups(q.shape[1], k.shape[1], ways, f"sparse_compile ({site}) on DTensors")

    def strategy(qkv, padding):
        mask = None
        if runtime_mask is not None:  # (batch or 1, heads or 1, q_len, kv_len): split with q where it has the dim
            mask = qkv if isinstance(qkv, Shard) and runtime_mask.shape[qkv.dim] > 1 else Replicate()
        inputs = [qkv, qkv, qkv, None, None, padding if key_padding is not None else None,
                  Replicate() if query_positions is not None else None, mask]
        return [qkv], inputs

    # replicated first: DTensor keeps the first of equally cheap strategies, so replicated inputs stay replicated
    strategies = [strategy(Replicate(), Replicate()), strategy(Shard(0), Shard(0))]
    if ways:
        strategies.append(strategy(Shard(1), Replicate()))
    return strategies


def is_dtensor(tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # never imported here: a DTensor implies it is loaded
    return module is not None and isinstance(tensor, module.DTensor)


def register_dtensor_sharding() -> None:
    """Register the op's DTensor sharding rule (once). The rewrite calls it when ``torch.distributed.tensor`` is
    loaded, so DTensor models need nothing more; importing DTensor costs a second, so it is not done otherwise."""
    if _REGISTERED.value or not dist.is_available():
        return
    with _REGISTER_LOCK:
        if _REGISTERED.value:
            return
        from torch.distributed.tensor.experimental import register_sharding

        # the op exists: ``import sparse_compile`` imports ``attention_op``, which registers it
        register_sharding(torch.ops.sparse_compile.causal_attention.default)(_causal_attention_sharding)
        _REGISTERED.value = True
