"""Attention computed by hand: ``softmax(q @ k^T * scale (+ mask)) @ v`` with no ``scaled_dot_product_attention``.

transformers' eager attention (the default of models whose attention SDPA cannot express, e.g. Gemma2's logit
soft-capping) builds attention from a matmul, a softmax and a second matmul. The rewrite has no SDPA call to
replace there, and it does not rewrite these: it cannot prove what the elementwise ops between the scores and the
softmax do (soft-capping, a bias, a mask). They are found here only to be reported: listed in ``runtime_stats()``
and ``explain`` and named in the compile-time warning, as sites that never run sparse.

The pattern is required whole, so that a classifier head (``softmax(x @ W)``, perhaps followed by a matmul) is
not taken for attention: a softmax over the last dimension whose input is a batched matmul of two activations of
3 or more dimensions (the scores), reached through elementwise ops only, and whose output (through dtype
conversions, dropout and views only) is the left operand of a second batched matmul. Both the torch-level graphs
Dynamo hands the backend and aten-level graphs are read: ops are matched by name.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from .report import SiteRecord

__all__ = ["find_eager_attention", "EAGER_RULE", "SOFTCAP_RULE", "FUSED_RULE", "is_eager"]

EAGER_RULE = "eager_attention"  # SiteRecord.rule of such a site
SOFTCAP_RULE = "eager_attention_softcap"  # one with tanh soft-capping: no sparse path for it, whatever the user does
FUSED_RULE = "fused_attention_module"  # PyTorch's own attention modules, kept whole by Dynamo

# calls Dynamo keeps whole (nn.MultiheadAttention, nn.TransformerEncoderLayer's fast path): attention inside, no
# SDPA call the rewrite could see
_FUSED = {"multi_head_attention_forward": "nn.MultiheadAttention (F.multi_head_attention_forward)",
          "_native_multi_head_attention": "nn.MultiheadAttention's fast path (torch._native_multi_head_attention)",
          "_transformer_encoder_layer_fwd": "nn.TransformerEncoderLayer's fast path "
                                            "(torch._transformer_encoder_layer_fwd)"}

_MATMULS = {"matmul", "bmm", "baddbmm", "__matmul__", "einsum"}
_SOFTMAXES = {"softmax", "_softmax", "_safe_softmax"}
# between the scores and the softmax: scaling, soft-capping, masks and biases, dtype conversions, views
_SCORE_OPS = {"mul", "mul_", "truediv", "div", "div_", "add", "add_", "sub", "sub_", "iadd", "imul", "itruediv",
              "tanh", "tanh_", "masked_fill", "masked_fill_", "where", "clamp", "clamp_min", "clamp_max", "to",
              "float", "half", "bfloat16", "type", "type_as", "_to_copy", "convert_element_type",
              "contiguous", "clone", "view", "_unsafe_view", "reshape"}
# between the softmax and the output matmul
_PROBABILITY_OPS = {"to", "float", "half", "bfloat16", "type", "type_as", "_to_copy", "convert_element_type",
                    "dropout", "native_dropout", "getitem", "contiguous", "clone", "view", "_unsafe_view",
                    "reshape", "expand"}
_MAX_STEPS = 16  # ops between the scores and the softmax (soft-capping and a mask take 5)

_REASON = "attention computed without scaled_dot_product_attention (matmul, softmax, matmul: eager attention)"
_SOFTCAP = ("attention computed without scaled_dot_product_attention (eager attention), with logit soft-capping "
            "(tanh between the scores and the softmax), which no sparse kernel computes: it stays dense")


def is_eager(record: SiteRecord) -> bool:
    """Whether ``record`` is attention found here (computed by hand, or inside a fused PyTorch call), not an SDPA
    site."""
    return record.rule in (EAGER_RULE, SOFTCAP_RULE, FUSED_RULE)


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)  # aten.bmm.default -> "bmm"
    if packet is not None:
        return getattr(packet, "__name__", "")
    return getattr(target, "__name__", "")


def _value(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return arg.meta.get("example_value", arg.meta.get("val"))
    return arg


def _operands(node: fx.Node) -> list:
    """The two multiplied tensors of a matmul-like node (None where it has not two)."""
    name = _name(node)
    if name == "baddbmm":  # input (a bias: Bloom's ALiBi), batch1, batch2; often by keyword
        args = [*node.args[1:3], *(node.kwargs[k] for k in ("batch1", "batch2") if k in node.kwargs)]
    elif name == "einsum":
        args = list(node.args[1:])
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = list(args[0])
    else:
        args = [*node.args[:2], *(node.kwargs[k] for k in ("other", "mat2") if k in node.kwargs)]
    return args if len(args) == 2 and all(isinstance(a, fx.Node) for a in args) else []


def _batched(node: fx.Node) -> bool:
    """A batched product of two activations (3 or more dimensions each), as attention's are; not x @ weight."""
    values = [_value(a) for a in _operands(node)]
    return len(values) == 2 and all(isinstance(v, torch.Tensor) and v.dim() >= 3 for v in values)


def _last_dim_softmax(node: fx.Node) -> bool:
    source = _value(node.args[0]) if node.args else None
    if not isinstance(source, torch.Tensor):
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return isinstance(dim, int) and dim in (-1, source.dim() - 1) and source.dim() >= 3


def _scores(softmax: fx.Node) -> tuple[Optional[fx.Node], bool]:
    """The batched matmul the softmax normalises, through elementwise ops only, and whether tanh is among them."""
    frontier, seen, capped = [softmax.args[0]], set(), False
    for _ in range(_MAX_STEPS):
        found = []
        for node in frontier:
            if not isinstance(node, fx.Node) or node in seen:
                continue
            seen.add(node)
            name = _name(node)
            if name in _MATMULS:
                if _batched(node):
                    return node, capped
                continue
            if name not in _SCORE_OPS:
                continue
            capped |= name.startswith("tanh")
            found.extend(a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node))
        frontier = found
        if not frontier:
            break
    return None, False


def _output(softmax: fx.Node) -> Optional[fx.Node]:
    """The batched matmul that takes the probabilities as its left operand (any operand of an einsum)."""
    frontier, seen = [softmax], set()
    for _ in range(_MAX_STEPS):
        found = []
        for node in frontier:
            for user in node.users:
                if user in seen:
                    continue
                seen.add(user)
                name = _name(user)
                if name in _MATMULS:
                    operands = _operands(user)
                    left = operands[:1] if name != "einsum" else operands
                    if node in left and _batched(user):
                        return user
                elif name in _PROBABILITY_OPS and user.args and user.args[0] is node:
                    found.append(user)
        frontier = found
        if not frontier:
            break
    return None


def _shape(arg: Any) -> tuple:
    value = _value(arg)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def find_eager_attention(gm: fx.GraphModule) -> list[SiteRecord]:
    """One record (never rewritten, with the reason) per attention computed by hand in ``gm``'s graph, and per
    fused PyTorch attention call."""
    from .rewrite import module_path

    records = []
    for node in gm.graph.nodes:
        fused = _FUSED.get(_name(node)) if node.op == "call_function" else None
        if fused is not None:
            query = node.args[0] if node.args else None
            dtype = getattr(_value(query), "dtype", None)
            records.append(SiteRecord(
                site=module_path(node) or f"<{node.name}>", node=node.name, q_shape=_shape(query), k_shape=(),
                dtype=str(dtype).replace("torch.", "") if dtype is not None else "?", rewritten=False,
                reason=f"attention inside {fused}, a fused call whose scaled_dot_product_attention the graph does not "
                       "show: it stays dense", rule=FUSED_RULE))
            continue
        if _name(node) not in _SOFTMAXES or not _last_dim_softmax(node):
            continue
        scores, capped = _scores(node)
        if scores is None:
            continue
        output = _output(node)
        if output is None:
            continue
        query, _ = _operands(scores)
        value = _operands(output)[1] if _name(output) != "einsum" else None
        dtype = getattr(_value(query), "dtype", None)
        records.append(SiteRecord(
            site=module_path(node) or module_path(scores) or f"<{node.name}>",
            node=node.name,
            q_shape=_shape(query),
            k_shape=_shape(value) if value is not None else (),
            dtype=str(dtype).replace("torch.", "") if dtype is not None else "?",
            rewritten=False,
            reason=_SOFTCAP if capped else _REASON,
            rule=SOFTCAP_RULE if capped else EAGER_RULE,
        ))
    return records
