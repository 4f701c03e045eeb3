"""The rewrite pass: every eligible ``scaled_dot_product_attention`` call becomes ``sparse_compile::causal_attention``.

Eligibility is ``rules.REWRITE_RULES``: small named rules, each with the reason it gives when it fails. A site
that fails any rule is left exactly as it was, and its ``SiteRecord`` says why. The rewritten op still decides per call
between dense and sparse (``pipeline.py``).

A site is causal either by ``is_causal=True`` or by an ``attn_mask`` built inside the graph that ``masks.py``
proves to be the causal mask, or the causal mask AND a key-padding mask read from one ``(batch, kv_len)`` input
(what transformers builds when traced), either also AND a sliding window or chunks (``SiteSpec.window`` /
``chunk``). A mask that arrives as a graph input (built outside the compiled function or before a graph break)
cannot be proven from the graph: the op receives it and checks its values at run time (``runtime_mask.py``),
running sparse only where they have one of those forms. Such a site gets the padding input instead of the mask, so
the whole mask subgraph becomes dead and is removed: no N x N mask is allocated. K/V that the model repeated to the
query heads (``repeat_kv``) are replaced by the originals and attention runs GQA-native.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .attention_op import OP, output_layout
from .config import SparseConfig
from .local import CAUSAL
from .masks import (MaskMatch, NotProven, analyse_mask, example_value, input_of, is_input_view, mutated_inputs,
                    proof_holds_at, removable_nodes, undo_repeat_kv)
from .report import SiteRecord
from .rules import REWRITE_RULES, first_failure, layer_index
from .site import SiteSpec

__all__ = ["rewrite_graph", "module_path", "find_sdpa_calls", "SdpaCall", "reads_mutated_input"]

log = logging.getLogger("sparse_compile")

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
if hasattr(torch.ops.aten, "scaled_dot_product_attention"):
    SDPA_TARGETS.add(torch.ops.aten.scaled_dot_product_attention.default)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@dataclass
class SdpaCall:
    """One traced attention call, the subject of ``rules.REWRITE_RULES``."""

    node: fx.Node
    args: dict[str, Any]
    site: str
    gm: Optional[fx.GraphModule] = None
    config: Optional[SparseConfig] = None
    _mask: Any = None  # MaskMatch or NotProven, computed once

    @property
    def mask(self):
        """What the site's ``attn_mask`` was proven to be: ``MaskMatch`` or ``NotProven`` (None without a mask)."""
        arg = self.args["attn_mask"]
        if arg is None:
            return None
        if self._mask is None:
            if not isinstance(arg, fx.Node):
                self._mask = NotProven(f"constant attn_mask {type(arg).__name__}")
            elif self.gm is None:
                self._mask = NotProven("no graph to analyse the mask in")
            else:
                self._mask = _analyse_cached(self.gm, self.node, arg, self.q, self.k)
        return self._mask

    def value(self, name: str):
        """The example (fake) tensor behind an argument, or the constant itself."""
        return example_value(self.args[name])

    @property
    def runtime_mask(self) -> Optional[fx.Node]:
        """The ``attn_mask`` node when the graph cannot prove it but the op can check it at run time: a 4-D bool
        or floating mask that is a graph input, or views and dtype conversions of one (a mask built outside the
        compiled function or before a graph break). None otherwise."""
        arg = self.args["attn_mask"]
        if not isinstance(arg, fx.Node) or not isinstance(self.mask, NotProven):
            return None
        example = self.value("attn_mask")
        if not (isinstance(example, torch.Tensor) and example.dim() == 4
                and (example.dtype == torch.bool or example.dtype.is_floating_point)):
            return None
        return arg if is_input_view(arg) else None

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype autocast runs this call in, where it casts the inputs: the traced output's dtype (Dynamo
        traces under the autocast in force) when an input's differs from it. None without such a cast."""
        out = example_value(self.node)
        if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
            return None
        inputs = [self.q, self.k, self.v]
        if all(isinstance(t, torch.Tensor) and t.dtype == out.dtype for t in inputs):
            return None
        return out.dtype

    @property
    def dtypes(self) -> tuple:
        """q, k and v's dtypes as the attention computes them (after autocast's cast)."""
        cast = self.autocast_dtype
        return (cast,) * 3 if cast is not None else (self.q.dtype, self.k.dtype, self.v.dtype)

    @property
    def q(self):
        return self.value("query")

    @property
    def k(self):
        return self.value("key")

    @property
    def v(self):
        return self.value("value")


def _analyse_cached(gm: fx.GraphModule, site: fx.Node, mask: fx.Node, q, k):
    cache = gm.meta.setdefault("sparse_compile_masks", {})
    key = (mask, str(q.shape[-2]), str(k.shape[-2]))
    result = cache.get(key)
    if result is None or (isinstance(result, MaskMatch) and not proof_holds_at(result, site)):
        result = analyse_mask(gm, site, mask, q, k)
        cache[key] = result
    return result


def module_path(node: fx.Node) -> str:
    """The module path of the innermost ``nn.Module`` a node came from, as ``named_modules()`` spells it."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1]
    path = raw[0] if isinstance(raw, tuple) else str(raw)
    # the traced root: L['self'], or L['args'][0] where the call reached forward through a wrapper taking the module
    # as its first argument (transformers 5.24)
    path = re.sub(r"^L\[['\"][^'\"]*['\"]\](\[\d+\])*\.?", "", path)
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


def find_sdpa_calls(gm: fx.GraphModule, config: Optional[SparseConfig] = None) -> list[SdpaCall]:
    calls = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            site = module_path(node) or f"<{node.name}>"
            calls.append(SdpaCall(node, _normalize(node), site, gm, config))
    return calls


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def _native_kv(call: SdpaCall) -> tuple[Any, Any, bool, tuple]:
    """K, V and enable_gqa for the op, and the nodes no longer read: the Hkv-head originals when the model
    repeated K/V to the query heads (transformers does whenever it passes a mask)."""
    key, value, gqa = call.args["key"], call.args["value"], bool(call.args["enable_gqa"])
    undone_k, undone_v = undo_repeat_kv(key), undo_repeat_kv(value)
    if undone_k and undone_v and undone_k[1] == undone_v[1] and undone_k[1] > 1:
        return undone_k[0], undone_v[0], True, undone_k[2] + undone_v[2]
    return key, value, gqa, ()


def _cast(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    example = example_value(node)
    if example.dtype == dtype:
        return node
    cast = gm.graph.call_method("to", (node, dtype))
    cast.meta.update(node.meta)
    cast.meta["example_value"] = example.to(dtype)
    return cast


def _heads_inner(call: SdpaCall) -> bool:
    """The replaced call's output layout (``attention_op.output_layout``); heads-inner when the graph has no
    example."""
    example = example_value(call.node)
    return output_layout(example) if isinstance(example, torch.Tensor) else True


def rewrite_graph(gm: fx.GraphModule, config: SparseConfig) -> list[SiteRecord]:
    """Rewrite eligible SDPA calls in place; returns one record per call site."""
    records = []
    dropped: set = set()  # mask slices and repeat_kv chains the rewritten sites no longer read
    for call in find_sdpa_calls(gm, config):
        call.args = _normalize(call.node)  # an earlier site's rewrite may have replaced one of its inputs
        failed = first_failure(REWRITE_RULES, call)
        q = call.q
        record = dict(
            site=call.site,
            node=call.node.name,
            q_shape=_shape(q),
            k_shape=_shape(call.k),
            dtype=str(q.dtype).replace("torch.", "") if isinstance(q, torch.Tensor) else "?",
        )
        if failed is not None:
            records.append(SiteRecord(rewritten=False, reason=failed.reason(call), rule=failed.name, **record))
            continue
        node = call.node
        mask = call.mask
        key, value, gqa, repeat_chain = _native_kv(call)
        if repeat_chain:
            dropped |= set(repeat_chain)
            record["k_shape"] = _shape(example_value(key))
        padding = positions = documents = None
        checked = call.runtime_mask if isinstance(mask, NotProven) else None
        if isinstance(mask, MaskMatch):
            padding, positions, documents = mask.key_padding, mask.query_positions, mask.documents
            dropped |= set(mask.nodes)
        local = mask.local if isinstance(mask, MaskMatch) else CAUSAL
        spec = SiteSpec(call.site, config, enable_gqa=gqa, queries_last=mask is not None,
                        binary_padding=isinstance(mask, MaskMatch) and mask.binary_padding,
                        heads_inner=_heads_inner(call), window=local.window, chunk=local.chunk)
        query = call.args["query"]
        with gm.graph.inserting_before(node):
            cast = call.autocast_dtype
            if cast is not None:  # as autocast casts SDPA's inputs (the op has no autocast rule of its own)
                query, key, value = (_cast(gm, t, cast) for t in (query, key, value))
            new = gm.graph.call_function(
                OP, (query, key, value, call.args["scale"], spec.to_json(), padding, positions, checked, documents),
            )
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        how = f"rewritten: method {config.method}"
        if isinstance(mask, MaskMatch):
            how += f"; {mask.reason}"
        elif checked is not None:
            how += (f"; attn_mask checked at run time (a graph input, not provable from the graph: {mask.reason}): "
                    "causal AND key padding runs sparse, any other mask dense SDPA with it")
        if gqa and not call.args["enable_gqa"]:
            how += "; repeated K/V undone (GQA native)"
        records.append(SiteRecord(rewritten=True, reason=how, **record))
    _warn_unmatched_skips(records, config)
    _warn_unmatched_site_params(records, config)
    _warn_unnamed_sites(records, config)
    if any(r.rewritten for r in records):
        if "torch.distributed.tensor" in sys.modules:  # the graph may run on DTensors: give the op its sharding rule
            from .parallel import register_dtensor_sharding

            register_dtensor_sharding()
        _erase(gm, dropped)
        gm.graph.lint()
        gm.recompile()
    return records


def reads_mutated_input(gm: fx.GraphModule) -> bool:
    """Whether a rewritten site reads, at run time, a graph input (its padding, query positions or mask) that the
    graph writes in place. Inductor writes such an input without bumping its version counter, so a summary read at
    one site cannot vouch for the next within the call: the backend then reads each site's inputs afresh."""
    mutated = mutated_inputs(gm.graph)
    if not mutated:
        return False
    return any(input_of(arg) in mutated for node in gm.graph.nodes if node.op == "call_function" and node.target is OP
               for arg in node.args[5:9] if isinstance(arg, fx.Node))


def _warn_unmatched_skips(records: list[SiteRecord], config: SparseConfig) -> None:
    """A layer index in skip_layers that no indexed site of this graph has is most likely a mistake."""
    indices = {layer_index(r.site) for r in records} - {None}
    missing = [i for i in config.skip_layers if isinstance(i, int) and indices and i not in indices]
    if missing:
        warnings.warn(f"sparse_compile: skip_layers {missing} matched no attention site of this graph (its layers: "
                      f"{min(indices)}..{max(indices)}); a site's layer index is the first integer in its module "
                      "path", stacklevel=2)


def _warn_unmatched_site_params(records: list[SiteRecord], config: SparseConfig) -> None:
    """site_params that name none of this graph's sites were most likely written for another compiled module
    (``calibrate(model)``, then ``torch.compile(model.model)``: every path loses its ``model.`` prefix)."""
    sites = [r.site for r in records if r.rewritten]
    names = {site for site, _ in config.site_params}
    if sites and names and not names.intersection(sites):
        warnings.warn(f"sparse_compile: site_params name none of this graph's {len(sites)} attention sites (e.g. "
                      f"{sites[0]!r}; site_params has e.g. {min(names)!r}); keys are module paths relative to the "
                      "compiled module, as runtime_stats() names them", stacklevel=2)


def _warn_unnamed_sites(records: list[SiteRecord], config: SparseConfig) -> None:
    """A site with no module path (the compiled frame is an attention function, not a module: transformers'
    continuous batching compiles its paged attention function alone) has no layer: skip_layers and site_params
    cannot reach it, and saying nothing would run a layer the user skipped sparse."""
    unnamed = sorted({r.site for r in records if r.rewritten and r.site.startswith("<")})
    if unnamed and (config.skip_layers or config.site_params):
        warnings.warn(f"sparse_compile: attention site(s) {unnamed} have no module path (the compiled frame is an "
                      "attention function, as under transformers' continuous batching), so skip_layers and "
                      "site_params cannot apply to them: they run the method's defaults. For continuous batching use "
                      "sparse_compile.serving_attention(model, config), which keeps each layer's site",
                      stacklevel=2)


def _erase(gm: fx.GraphModule, candidates: set) -> None:
    for node in removable_nodes(gm, {n for n in candidates if isinstance(n, fx.Node)}):
        if not node.users:
            gm.graph.erase_node(node)
