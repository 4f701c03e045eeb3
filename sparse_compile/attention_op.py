"""The registered op the rewrite inserts, its fake implementation and its output layout.

``torch.ops.sparse_compile.causal_attention`` is opaque to Inductor: the choice between dense and sparse is
made per call (``pipeline.py``), from the actual shapes and the ``sparsity`` region in force. So one compiled
graph serves every prompt length and every region without recompiling. The op takes the site's tensors and one
``SiteSpec`` (``site.py``) as a JSON string.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .parallel import active_sequence_group, run_sequence_parallel
from .pipeline import attend_site
from .rules import forward_ad_active, validate_qkv
from .site import SiteSpec

__all__ = ["causal_attention", "output_layout", "in_output_layout", "OP"]

# run-time decisions and host-side bookkeeping must run on every call: never capture the op in a CUDA graph
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("sparse_compile::causal_attention", mutates_args=(), tags=_TAGS)
def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], spec: str,
                     key_padding: Optional[Tensor] = None, query_positions: Optional[Tensor] = None,
                     runtime_mask: Optional[Tensor] = None, documents: Optional[Tensor] = None) -> Tensor:
    """Drop-in for the attention call the rewrite replaced; ``spec`` is its ``SiteSpec`` as JSON.

    ``spec.queries_last`` False: ``scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
    enable_gqa=...)`` (causal aligned top-left). True: the call had a traced mask proven causal with the queries at
    the last positions, AND the key padding ``key_padding`` (batch, kv_len; nonzero = valid) when given;
    ``query_positions`` is the ``cache_position`` input the mask read, held to ``arange(kv_len - q_len, kv_len)``.
    ``runtime_mask``: the call's ``attn_mask``, a graph input the rewrite could not prove: checked per forward pass
    (``runtime_mask.py``); causal AND key padding runs as a proven mask, anything else as the original call.
    ``documents``: the ``(batch, kv_len)`` position ids of a mask proven causal within the documents packed in each
    row (a new one wherever a position is not its predecessor's plus one): each document runs on its own.
    """
    site = SiteSpec.from_json(spec)
    # an empty call, or (is_causal, top-left) more queries than keys: valid SDPA calls, run dense (RUNTIME_RULES)
    validate_qkv(q, k, v, who=f"sparse_compile.causal_attention ({site.site})", empty_ok=True,
                 longer_queries_ok=not site.queries_last or runtime_mask is not None)
    if forward_ad_active():
        # PyTorch's custom ops drop forward-mode tangents silently: refuse rather than return a tangent-less result
        # (the backend runs a graph called under forward AD without this op, and sparse_attention goes dense)
        raise RuntimeError(
            f"sparse_compile.causal_attention ({site.site}): called under forward-mode AD (forward_ad.dual_level); "
            "this op has no forward derivative. Call the compiled model or sparse_attention instead: they run such "
            "calls through dense attention."
        )
    # sequence parallelism (parallel.sequence_parallel): q/k/v are this rank's chunk of one sequence; the Ulysses
    # all-to-all runs the pipeline on whole sequences for this rank's share of the heads
    group = active_sequence_group()
    if group is None:
        out = attend_site(q, k, v, scale, site, key_padding, query_positions, runtime_mask, documents)
    elif runtime_mask is not None or documents is not None:
        # each rank holds its chunk of the mask: it cannot be checked for, or applied to, the whole sequence
        raise RuntimeError(
            f"sparse_compile.causal_attention ({site.site}): this site's attn_mask arrives as a graph input (checked "
            "at run time), which sequence_parallel does not support: each rank's mask covers its own chunk only. "
            "Build the mask inside the compiled function, or pass is_causal=True."
        )
    else:
        out = run_sequence_parallel(attend_site, group, q, k, v, scale, site, key_padding, query_positions)
    return in_output_layout(out, site.heads_inner)


OP = torch.ops.sparse_compile.causal_attention.default  # what the rewrite inserts and the sharding rule names


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale, spec, key_padding=None, query_positions=None, runtime_mask=None,
                           documents=None):
    if SiteSpec.from_json(spec).heads_inner:
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1])).transpose(1, 2)
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[-1]))


def output_layout(example: Tensor) -> bool:
    """``heads_inner`` for the op that replaces an attention call whose (fake) output is ``example``: True when its
    memory is (B, N, H, D) (what SDPA's fused GPU kernels return, and what CPU SDPA returns for the usual
    transposed projections), False for contiguous (B, H, N, D). The op returns the replaced call's layout, so a
    program that views the output (``o.view(B, H * N, D)``) keeps working; strides are compared only where they
    are known without a guard (symbolic lengths: contiguous (B, H, N, D) has stride(1) = N * D)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if example.dim() != 4 or example.shape[1] == 1:
        return True
    return bool(statically_known_true(example.stride(1) < example.stride(2)))


def _output_strides(shape, heads_inner: bool) -> tuple[int, ...]:
    batch, heads, length, dim = shape
    if heads_inner:
        return length * heads * dim, dim, heads * dim, 1
    return heads * length * dim, length * dim, dim, 1


def in_output_layout(out: Tensor, heads_inner: bool = True) -> Tensor:
    """``out`` (B, H, N, D) in the memory layout the fake above promises, whatever the path returned.

    A fixed layout per site, so Inductor's stride assumptions hold however it lays q out. The usual one is
    heads-inner ((B, N, H, D) memory): what attention outputs are read in next (``out.transpose(1, 2).reshape(B,
    N, H * D)``), so that step copies nothing; SDPA's fused kernels and the sparse kernel (which mirrors q's
    projection layout) already return it: no copy then. Sizes of 1 carry no layout: any stride passes there.
    """
    expected = _output_strides(out.shape, heads_inner)
    if all(size == 1 or stride == want for size, stride, want in zip(out.shape, out.stride(), expected)):
        return out
    if heads_inner:
        fixed = out.new_empty((out.shape[0], out.shape[2], out.shape[1], out.shape[3])).transpose(1, 2)
    else:
        fixed = out.new_empty(out.shape)
    return fixed.copy_(out)
