"""The rewrite pass: every eligible ``scaled_dot_product_attention`` call becomes ``sparse_compile::causal_attention``.

Eligibility is a list of small named rules, each with the reason it gives when it fails (the style of
Inductor's ``fx_passes/fuse_attention.py``). A site that fails any rule is left exactly as it was, and its
``SiteRecord`` says why. The rewritten op still decides per call between dense and sparse (see ``ops.py``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .config import SparseConfig
from .report import SiteRecord

__all__ = ["rewrite_graph", "REWRITE_RULES", "head_dim_supported", "module_path", "layer_index"]

log = logging.getLogger("sparse_compile")

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
if hasattr(torch.ops.aten, "scaled_dot_product_attention"):
    SDPA_TARGETS.add(torch.ops.aten.scaled_dot_product_attention.default)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
REWRITE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# head dims the sparse kernels serve: powers of two run natively, other multiples of 8 are padded on chip
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def head_dim_supported(dim) -> bool:
    return isinstance(dim, int) and MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM and dim % 8 == 0


@dataclass
class SdpaCall:
    node: fx.Node
    args: dict[str, Any]
    site: str

    def value(self, name: str):
        """The example (fake) tensor behind an argument, or the constant itself."""
        arg = self.args[name]
        if isinstance(arg, fx.Node):
            return arg.meta.get("example_value", arg.meta.get("val"))
        return arg

    @property
    def q(self):
        return self.value("query")

    @property
    def k(self):
        return self.value("key")

    @property
    def v(self):
        return self.value("value")


@dataclass(frozen=True)
class RewriteRule:
    name: str
    holds: Callable[[SdpaCall, SparseConfig], bool]
    reason: Callable[[SdpaCall, SparseConfig], str]


def _is_const(call: SdpaCall, name: str) -> bool:
    return not isinstance(call.args[name], fx.Node)


def _tensors_known(call: SdpaCall) -> bool:
    return all(isinstance(t, torch.Tensor) for t in (call.q, call.k, call.v))


def _lengths_may_match(call: SdpaCall) -> bool:
    nq, nk = call.q.shape[-2], call.k.shape[-2]
    if isinstance(nq, int) and isinstance(nk, int):
        return nq == nk
    return True  # symbolic lengths: the op decides per call


def layer_index(path: str) -> Optional[int]:
    """The first integer component of a module path: ``model.layers.3.self_attn`` -> 3."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else None


def _excluded(call: SdpaCall, config: SparseConfig) -> Optional[str]:
    index = layer_index(call.site)
    for item in config.skip_layers:
        if isinstance(item, int) and index == item:
            return f"layer {index} is in skip_layers"
        if isinstance(item, str) and item in call.site:
            return f"module path matches skip_layers entry {item!r}"
    return None


REWRITE_RULES: tuple[RewriteRule, ...] = (
    RewriteRule("tensors_known", lambda c, cfg: _tensors_known(c), lambda c, cfg: "no example tensors on the node"),
    RewriteRule(
        "four_d",
        lambda c, cfg: all(t.dim() == 4 for t in (c.q, c.k, c.v)),
        lambda c, cfg: f"inputs are not 4-D (q {tuple(c.q.shape)})",
    ),
    RewriteRule(
        "no_mask",
        lambda c, cfg: c.args["attn_mask"] is None,
        lambda c, cfg: "explicit attn_mask (padding, packed sequences or a custom mask; transformers also builds "
        "one when called with use_cache=False)",
    ),
    RewriteRule(
        "causal",
        lambda c, cfg: _is_const(c, "is_causal") and c.args["is_causal"] is True,
        lambda c, cfg: "not causal (is_causal=False): encoder, cross-attention or a decode step",
    ),
    RewriteRule(
        "no_dropout",
        lambda c, cfg: _is_const(c, "dropout_p") and float(c.args["dropout_p"]) == 0.0,
        lambda c, cfg: f"dropout_p={c.args['dropout_p']} (training)",
    ),
    RewriteRule(
        "dtype",
        lambda c, cfg: c.q.dtype in REWRITE_DTYPES and c.k.dtype == c.q.dtype and c.v.dtype == c.q.dtype,
        lambda c, cfg: f"dtype {c.q.dtype} not supported (float16, bfloat16, float32)",
    ),
    RewriteRule(
        "head_dim",
        lambda c, cfg: head_dim_supported(c.q.shape[-1]) and c.v.shape[-1] == c.q.shape[-1],
        lambda c, cfg: f"head dim {c.q.shape[-1]} (value {c.v.shape[-1]}) not supported; supported: multiples of 8 "
        f"in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] with an equal value dim",
    ),
    RewriteRule(
        "heads",
        lambda c, cfg: c.q.shape[1] % c.k.shape[1] == 0
        and (c.q.shape[1] == c.k.shape[1] or (_is_const(c, "enable_gqa") and c.args["enable_gqa"] is True)),
        lambda c, cfg: f"query heads {c.q.shape[1]} vs key/value heads {c.k.shape[1]} without enable_gqa",
    ),
    RewriteRule(
        "self_attention",
        lambda c, cfg: _lengths_may_match(c),
        lambda c, cfg: f"q_len {c.q.shape[-2]} != kv_len {c.k.shape[-2]} (cross-attention or cached prefill)",
    ),
    RewriteRule(
        "inference",
        lambda c, cfg: not (c.q.requires_grad or c.k.requires_grad or c.v.requires_grad),
        lambda c, cfg: "inputs require grad: the sparse path is forward-only (inference)",
    ),
    RewriteRule(
        "layer_selected",
        lambda c, cfg: _excluded(c, cfg) is None,
        lambda c, cfg: _excluded(c, cfg) or "",
    ),
)


def module_path(node: fx.Node) -> str:
    """The module path of the innermost ``nn.Module`` a node came from, as ``named_modules()`` spells it."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1]
    path = raw[0] if isinstance(raw, tuple) else str(raw)
    path = re.sub(r"^L\[['\"][^'\"]*['\"]\]\.?", "", path)  # the traced root, e.g. L['self']
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    return path.strip(".")


def _normalize(node: fx.Node) -> dict[str, Any]:
    args = dict(SDPA_DEFAULTS)
    for name, arg in zip(SDPA_PARAMS, node.args):
        args[name] = arg
    for name, arg in node.kwargs.items():
        args[{"q": "query", "k": "key", "v": "value"}.get(name, name)] = arg
    return args


def find_sdpa_calls(gm: fx.GraphModule) -> list[SdpaCall]:
    calls = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            site = module_path(node) or f"<{node.name}>"
            calls.append(SdpaCall(node, _normalize(node), site))
    return calls


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def rewrite_graph(gm: fx.GraphModule, config: SparseConfig) -> list[SiteRecord]:
    """Rewrite eligible SDPA calls in place; returns one record per call site."""
    from .ops import config_to_json  # importing ops registers torch.ops.sparse_compile.causal_attention

    config_json = config_to_json(config)
    records = []
    for call in find_sdpa_calls(gm):
        failed = next((rule for rule in REWRITE_RULES if not rule.holds(call, config)), None)
        q = call.q
        record = dict(
            site=call.site,
            node=call.node.name,
            q_shape=_shape(q),
            k_shape=_shape(call.k),
            dtype=str(q.dtype).replace("torch.", "") if isinstance(q, torch.Tensor) else "?",
        )
        if failed is not None:
            records.append(SiteRecord(rewritten=False, reason=failed.reason(call, config), **record))
            continue
        node = call.node
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.sparse_compile.causal_attention.default,
                (call.args["query"], call.args["key"], call.args["value"], call.args["scale"],
                 bool(call.args["enable_gqa"]), call.site, config_json),
            )
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        records.append(SiteRecord(rewritten=True, reason=f"rewritten: method {config.method}", **record))
    if any(r.rewritten for r in records):
        gm.graph.lint()
        gm.recompile()
    return records
