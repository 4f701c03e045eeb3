"""Recognising the attention masks that models build inside a traced graph, with a proof that holds at every length.

Under Dynamo, transformers cannot look at mask values, so it materialises the mask in the graph: an additive float
mask built with ``full``/``triu`` and in-place updates (4.46-4.52), a bool mask built by nested functorch vmaps
(4.53-4.57) or by broadcasting aranges (5.x). The constructions differ by version; what they compute does not. So
instead of matching each construction, ``analyse_mask`` proves what a mask *is*: the causal mask, ``key j visible to
query i iff j <= i + kv_len - q_len``, optionally AND a sliding window or chunks (``Local``, step 7), optionally AND
a key-padding mask, at every length the graph can run at. What it cannot establish comes back as ``NotProven`` with
a reason, and the site stays dense.

1. The slice: the backward slice of the mask node. Size queries (``x.size(1)``, ``x.shape``) are leaves evaluated
   from the traced shapes, so the slice never reaches the model's activations. In-place mutations of the slice's
   tensors or of their views (``setitem``, ``mul_``, ``*=``) are part of it even though they are not ancestors of
   the mask node, and so are the global-state calls that bracket it (vmap nesting, autocast).
2. Inputs: allowed are none, one ``(batch, kv_len)`` tensor (a tokenizer's ``attention_mask``) and one ``(q_len,)``
   integer tensor (``cache_position``, held to the canonical positions at run time). Any other input read by value
   (a buffer, a float attribute that Dynamo lifted to an input, a second mask) can change without a recompile: the
   mask is not proven.
3. Lengths. Static shapes run only at the traced sizes (Dynamo guards on them): a mask of up to ``EXACT_ELEMENTS``
   is evaluated at exactly those sizes, nothing substituted, so the comparison is the proof. Dynamic shapes (and
   longer static masks) are evaluated at substituted lengths, which needs the two steps below.
4. Constants: the reach. The slice is evaluated at two lengths and every call's operands are summarised (min and
   max of their values). An operand whose values differ between the two is length-dependent; one whose values do
   not is a constant, whatever produced it: a literal, a float attribute Dynamo inlined, ``self.window / 2``, a
   tensor computed from constants, a ``.item()``. A call that combines the two can change behaviour only where an
   end of the length-dependent operand's range meets a constant's value, at the length found by following that end
   linearly from the two measurements: a comparison flips, a clamp saturates, a floor division or remainder wraps,
   an added offset moves a later comparison. Positions along an index (``triu``'s diagonal, slice bounds,
   ``narrow``) bite at themselves. Scaling by one constant is no threshold (the scaled operand is followed where it
   is compared); scaling by a constant holding several values (per-head slopes) makes elements grow at different
   rates: not bounded. Selections (``where``, ``masked_fill``), factories, shape and dtype changes compare nothing.
   Both lengths are moved past twice the largest bite plus a margin and everything is measured again there, until
   no bite lies beyond them (an end that grows sub-linearly is thus followed from where it matters). A bite that
   cannot be bounded (an infinite or NaN value next to a length-dependent one, a range whose ends do not move), or
   lengths past ``MAX_EVAL_LENGTH``/``MAX_EVAL_ELEMENTS``: not proven.
5. The check: the mask must equal the expected one at small lengths (``SMALL_LENGTHS``), around every bite (where a
   constant starts to matter), and at the two lengths past every bite; a cached prefix (kv_len's own symbol) at 5 keys
   and as long as the queries; lengths the shape guards exclude (every guard over the evaluated symbols) are skipped.
   A mask whose key dim spells kv_len with another symbol (built once from layer 0's cache, met at a later layer
   sized by its own; a sliding cache's ``window - 1 + q_len`` against k's ``cached + q_len``) gives that symbol the
   value that makes them equal: SDPA's shape check (a bare symbol) or Dynamo's guard on that equality (any other
   form) holds it wherever the graph runs. A size that sizes nothing and that the guards bound below (a sliding
   cache's count of tokens seen, where its queries start) is evaluated at its lowest value, one above and ``n``
   above at every point (``n`` above in the reach, so a constant it meets is a bite); at static lengths it is the
   reach's only moving value. A static mask too long to evaluate at its own length is proven only when that length
   is itself past every bite. A bool mask keeps True; a float
   mask keeps 0 and masks values at or below ``finfo.min / 2``. Query rows that see no key under the expected mask are
   not compared: every implementation leaves them undefined (transformers even unmasks them on CUDA).
6. Padding values: 0/1 masks with left, right, random and no padding. Values other than 0 and 1 (-1, 2, 0.5, inf,
   NaN) are proven only where the slice reads the padding through nothing but "nonzero" (``!= 0``, ``== 0``,
   ``bool()``, ``to(torch.bool)``, logical ops) after views and gathers: such a mask cannot tell -1 from 1, as the op
   cannot (a trial with such values confirms it). Anything else (``am > 0``, ``am >= 1``, arithmetic) is proven for
   0/1 values only (``binary_padding``), and the op refuses other values at run time with an error.
7. Windows and chunks (``MaskMatch.local``). The widths are read from the mask, not from the graph: evaluated with
   every key valid, at the longest point (past every bite) and, where that shows one, at every point, each row's
   first visible key gives the window (the widest row) and the chunk size (the gcd of where rows' keys start, or of
   the rows that see themselves only: chunks AND a window); the simplest ``Local`` that fits every row is the
   candidate. That is a guess, not the proof: the widths are then bites of the expected mask (the points around
   them, and both lengths past twice the largest), and step 5 compares the mask with ``Local.visible`` AND the
   padding at every point and padding trial. So a width the graph hides is found past, or the comparison fails: a
   window per head, a window OR anything, a width that changes along the rows or with the length, non-integer
   chunks stay NotProven; ``i - j < 3.5`` is a window of 4 at integer positions, and proven so. Positions are the
   keys' positions in the row; chunks start at each row's first valid key (transformers' ``left_padding``), so
   chunks counted from key 0 (older transformers) are refuted by the left-padding trial. With holes in the padding
   the window is over those raw positions, not over the valid keys: what the op runs (such rows dense with the
   mask in raw positions), as for left or right padding, where both agree. Packed documents carry no ``Local``.

Soundness rests on these assumptions; nothing else is taken on trust:
- Each call of the slice is a deterministic function of its operands that changes behaviour with the length only
  where an end of a length-dependent operand's range meets a constant it is combined with, and those ends move
  monotonically with the length (piecewise-polynomial in the indices with breakpoints at the constants).
  Length-dependent values combined with each other (``i`` with ``j``, the length with the positions) have the
  same pattern at every length. A pattern periodic in the length itself (``(n // c) % 2``) is checked around its
  breakpoints up to twice the largest.
- A size the guards bound below moves the mask only where it meets a constant (as a length does); a cache's count
  of tokens seen is only ever compared through the positions it starts.
- Sizes that are not lengths (a dynamic batch) keep their traced values. The slice may use them to shape tensors
  and to count rows that index a tensor (``arange(batch)`` selecting the padding's rows); any other use of
  their value is not proven, so the mask's pattern cannot depend on them.
- The mask is elementwise in the padding (key j's padding value decides key j's column), checked on four patterns.
- Long static masks only: literals within 2 of the traced length are that length.
Nothing else can slip through because every value the slice reads is a size (substituted and evaluated), an input
(refused unless it is the padding or the positions, which are covered above), or computed inside the slice from
those and constants, and every constant is observed by value at the call that combines it with a length.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import sympy
import torch
import torch.fx as fx

from .local import CAUSAL, Local

__all__ = ["MaskMatch", "NotProven", "analyse_mask", "removable_nodes", "undo_repeat_kv", "example_value",
           "is_input_view", "proof_holds_at", "mutated_inputs", "input_of", "document_ids"]

# evaluation lengths (odd, unaligned with any block size): the first pair, and how the reach moves past constants
FIRST_LENGTH = 19
LENGTH_STEP = 18
REACH_FACTOR = 2  # evaluate past twice the length at which the largest constant starts to change the mask
REACH_MARGIN = 17
MAX_ROUNDS = 8
SMALL_LENGTHS = (2, 3, 5, 19, 37)  # dynamic shapes also run short prompts: checked too
SMALL_PREFIX = 5  # a cached prefix (kv_len's own symbol), and also one as long as the queries
EXACT_ELEMENTS = 1 << 22  # a static mask up to this many elements is evaluated at its own sizes
MAX_EVAL_LENGTH = 8448  # past the reach of a 4,096-key window (Mistral, Qwen2, Cohere2): 2 * 4096 + 19 = 8211
MAX_EVAL_ELEMENTS = 1 << 28

_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.ipow}
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "unsqueeze", "squeeze",
                 "transpose", "permute", "t", "narrow", "select", "as_strided", "flatten", "unflatten",
                 "contiguous", "to", "type", "type_as", "float", "half", "bfloat16", "bool", "long", "int",
                 "detach", "diagonal", "movedim", "__getitem__"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.squeeze,
                   torch.unsqueeze, torch.narrow, torch.select, torch.flatten, torch.movedim, torch.diagonal,
                   torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.view, torch.Tensor.expand}
# calls that change global state around the mask's construction: executed with it, and unwound afterwards
_BRACKET_NAMES = {"_vmap_increment_nesting", "_vmap_decrement_nesting", "lazy_load_decompositions",
                  "_enter_autocast", "_exit_autocast", "_set_grad_enabled"}
_METADATA_METHODS = {"size", "dim", "numel", "stride"}
_METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}


@dataclass(frozen=True)
class MaskMatch:
    """A mask proven to be causal (queries at the last positions), optionally AND a per-key padding mask."""

    key_padding: Optional[fx.Node]  # the (batch, kv_len) input it reads, nonzero = valid key
    query_positions: Optional[fx.Node]  # the (q_len,) input it reads (cache_position), if any
    nodes: frozenset  # the slice: what the graph no longer needs once the mask is dropped
    binary_padding: bool = False  # proven for 0/1 padding values only (other values mean something else here)
    # the (batch, n) position ids it reads instead of a padding mask: documents packed in a row, each causal on its
    # own, a new one wherever a position is not its predecessor's plus one (transformers' packed sequences)
    documents: Optional[fx.Node] = None
    # also a sliding window / chunked local attention (``local.py``), in the keys' positions in the row: chunks
    # start at the row's first valid key, and a row whose valid keys have holes has its window in those positions,
    # not among its valid keys (the same as among them for left or right padding)
    local: Local = CAUSAL

    @property
    def reason(self) -> str:
        if self.documents is not None:
            return (f"causal mask within the documents packed in each row proven from the graph (documents from the "
                    f"position ids in input {self.documents.name})")
        what = "causal mask" if self.local.is_causal else f"causal mask AND {self.local.describe()}"
        what += "" if self.key_padding is None else " AND key padding"
        values = " (0/1 padding values)" if self.binary_padding else ""
        return f"{what} proven from the graph ({_describe(self.key_padding, self.query_positions)}){values}"


@dataclass(frozen=True)
class NotProven:
    reason: str


def _describe(padding: Optional[fx.Node], positions: Optional[fx.Node]) -> str:
    parts = []
    if padding is not None:
        parts.append(f"padding from input {padding.name}")
    if positions is not None:
        parts.append(f"query positions from input {positions.name}")
    return ", ".join(parts) or "a function of sizes only"


def example_value(node: Any):
    """A graph node's traced (fake) value, or the argument itself when it is a constant."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def _is_size_query(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target in _METADATA_METHODS:
        return True
    if node.op == "call_function":
        if node.target is getattr and len(node.args) == 2 and node.args[1] in _METADATA_ATTRIBUTES:
            return True
        name = getattr(node.target, "__name__", "")
        return name.startswith("sym_size") or name.startswith("sym_numel") or name.startswith("sym_stride")
    return False


def _is_mutation(node: fx.Node) -> bool:
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS or "out" in node.kwargs or node.kwargs.get("inplace") is True:
            return True
        name = getattr(node.target, "__name__", "")  # torch.relu_, torch.Tensor.masked_fill_ called as functions
        if name.endswith("_") and not name.endswith("__"):
            return True
        schema = getattr(node.target, "_schema", None)
        return bool(schema is not None and schema.is_mutable)
    if node.op == "call_method":
        name = str(node.target)
        return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs
    return False


def _is_bracket(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _BRACKET_NAMES


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


def _root(node: fx.Node) -> fx.Node:
    """The tensor a view chain starts from (conservative: every op that may return an alias is a view here)."""
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _slice(mask: fx.Node, site: fx.Node, order: dict) -> set:
    """Ancestors of ``mask`` (size queries are leaves), plus the in-place mutations of their aliases that run
    before ``site``, plus the bracketing global-state calls in between: everything the mask's value depends on."""
    nodes: set = set()
    stack = [mask]
    mutations = [n for n in site.graph.nodes if _is_mutation(n) and order[n] < order[site]]

    def add(start: list) -> None:
        while start:
            node = start.pop()
            if node in nodes:
                continue
            nodes.add(node)
            if node.op in ("placeholder", "get_attr") or _is_size_query(node):
                continue
            start.extend(node.all_input_nodes)

    add(stack)
    while True:
        roots = {_root(n) for n in nodes}
        extra = [m for m in mutations
                 if m not in nodes and isinstance(m.args[0], fx.Node) and _root(m.args[0]) in roots]
        if not extra:
            break
        add(extra)
    body = [n for n in nodes if n.op not in ("placeholder", "get_attr")]
    if body:
        first, last = min(order[n] for n in body), max(order[n] for n in body)
        brackets = [n for n in site.graph.nodes if _is_bracket(n) and first <= order[n] <= last]
        add(brackets)
    return nodes


# -- sizes: which values are lengths, and what they become in an evaluation ---------------------------------------
@dataclass
class _Sizes:
    """How to turn the traced sizes into the sizes of one evaluation."""

    symbols: dict = field(default_factory=dict)  # sympy symbol -> int
    literals: dict = field(default_factory=dict)  # static int (a length, or a length +- 2) -> int

    def value(self, x: Any) -> Any:
        if isinstance(x, torch.SymInt):
            expr = x.node.expr
            return int(expr.xreplace({s: self.symbols[s] for s in expr.free_symbols if s in self.symbols}))
        if isinstance(x, bool):
            return x
        if isinstance(x, int):
            return self.literals.get(x, x)
        if isinstance(x, (tuple, list)):
            return type(x)(self.value(i) for i in x) if not isinstance(x, torch.Size) else torch.Size(
                [self.value(i) for i in x])
        if isinstance(x, slice):
            return slice(self.value(x.start), self.value(x.stop), self.value(x.step))
        if isinstance(x, dict):
            return {k: self.value(v) for k, v in x.items()}
        return x


def _symbols(x: Any) -> set:
    return set(x.node.expr.free_symbols) if isinstance(x, torch.SymInt) else set()


def _hint(symbol, shape_env) -> Optional[int]:
    if shape_env is None:
        return None
    values = getattr(shape_env, "backed_var_to_val", None)
    value = (values if values is not None else shape_env.var_to_val).get(symbol)
    return int(value) if value is not None else None


# -- evaluation -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _contained_global_state():
    """Run the slice's vmap/autocast/grad-mode calls; whatever they leave open is closed afterwards."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    grad = torch.is_grad_enabled()
    state = {"vmap": 0, "autocast": []}
    try:
        with unset_fake_temporarily(), torch.no_grad():
            yield state
    finally:
        for _ in range(state["vmap"]):
            torch._C._functorch._vmap_decrement_nesting()
        for ctx in reversed(state["autocast"]):
            torch.amp.autocast_mode._exit_autocast(ctx)
        torch.set_grad_enabled(grad)


def _evaluate(gm: fx.GraphModule, nodes: list, mask: fx.Node, sizes: _Sizes, inputs: dict,
              observe=None) -> torch.Tensor:
    """The mask at ``sizes``; ``observe(node, args, kwargs)`` sees each call's operands as it runs."""
    env: dict = {}

    def load(x: Any) -> Any:
        if isinstance(x, fx.Node):
            return env[x]
        return sizes.value(x)

    with _contained_global_state() as state:
        for node in nodes:
            if node.op == "placeholder":
                if node in inputs:
                    env[node] = inputs[node]
                elif not isinstance(example_value(node), torch.Tensor):
                    env[node] = sizes.value(example_value(node))  # a SymInt input
                continue  # a tensor input read only by size: never loaded
            if node.op == "get_attr":
                value = gm
                for part in str(node.target).split("."):
                    value = getattr(value, part)
                env[node] = value
                continue
            if _is_size_query(node):
                env[node] = _metadata(node, sizes)
                continue
            args = fx.node.map_aggregate(node.args, load)
            kwargs = fx.node.map_aggregate(node.kwargs, load)
            if observe is not None:
                observe(node, args, kwargs)
            if node.op == "call_method":
                self_arg, *rest = args
                result = getattr(self_arg, node.target)(*rest, **kwargs)
            else:
                result = node.target(*args, **kwargs)
            name = getattr(node.target, "__name__", "")
            if name == "_vmap_increment_nesting":
                state["vmap"] += 1
            elif name == "_vmap_decrement_nesting":
                state["vmap"] -= 1
            elif name == "_enter_autocast":
                state["autocast"].append(result)
            elif name == "_exit_autocast" and state["autocast"]:
                state["autocast"].pop()
            env[node] = result
        return env[mask]


def _metadata(node: fx.Node, sizes: _Sizes) -> Any:
    """A size query answered from the traced example value, at the evaluation's sizes."""
    example = example_value(node.args[0])
    if node.op == "call_method":
        method = node.target
        dims = [sizes.value(d) for d in example.shape]
        if method == "size":
            return dims[node.args[1]] if len(node.args) > 1 else torch.Size(dims)
        if method == "dim":
            return len(dims)
        if method == "numel":
            total = 1
            for d in dims:
                total *= d
            return total
        raise _Unsupported(f"size query {method}")
    if node.target is getattr:
        attr = node.args[1]
        if attr == "shape":
            return torch.Size([sizes.value(d) for d in example.shape])
        if attr == "ndim":
            return example.dim()
        return getattr(example, attr)
    # torch.ops.aten.sym_size.int(x, dim)
    return sizes.value(example.shape[node.args[1]])


class _Unsupported(Exception):
    pass


def _keep(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Which entries a mask keeps (bool), or None when it is not a pure mask (a float bias)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        keep = mask == 0
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if bool((keep | masked).all()):
            return keep
    return None


def _expected(batch: int, nq: int, nk: int, padding: Optional[torch.Tensor], device,
              documents: Optional[torch.Tensor] = None, local: Local = CAUSAL) -> torch.Tensor:
    qpos = torch.arange(nk - nq, nk, device=device)
    keys = torch.arange(nk, device=device)
    if local.chunk and padding is not None:  # chunks start at each row's first valid key (nk: none)
        first = torch.where(padding != 0, keys, nk).amin(-1)[:, None]  # (B, 1)
        out = local.visible(qpos - first, keys - first)  # (B, nq, nk)
    else:  # a window is the same relative to any origin
        out = local.visible(qpos, keys).expand(batch, nq, nk)
    if padding is not None:
        out = out & (padding != 0)[:, None, :]
    if documents is not None:
        ids = document_ids(documents)
        out = out & (ids[:, -nq:, None] == ids[:, None, :])
    return out


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(batch, n) position ids -> the index of each token's document in its row: a document starts wherever a
    position is not its predecessor's plus one (transformers' packed sequences, ``find_packed_sequence_indices``)."""
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def _document_trials(batch: int, n: int, dtype: torch.dtype, device, generator: torch.Generator) -> list:
    """Position ids of packed documents: one, two, restarts at 0 and elsewhere, jumps, one-token documents."""
    cols = torch.arange(n)
    one = cols.expand(batch, n)
    half = torch.where(cols < n // 2, cols, cols - n // 2).expand(batch, n)
    every = (cols % 3).expand(batch, n)  # documents of three tokens
    jumps = torch.where(cols < n // 3, cols + 5, cols + 40).expand(batch, n)  # starts past 0, then jumps ahead
    singles = torch.where(cols % 2 == 0, torch.zeros_like(cols), cols).expand(batch, n)  # 0, 1, 0, 3, 0, 5, ...
    restarts = torch.rand(batch, n, generator=generator) < 0.15
    random_docs = cols[None, :] - torch.cummax(torch.where(restarts, cols[None, :], 0), dim=1).values
    trials = [one, half, every, jumps, singles, random_docs]
    return [t.to(device=device, dtype=dtype).contiguous() for t in trials]


def _padding_trials(batch: int, nk: int, dtype: torch.dtype, device, generator: torch.Generator) -> list:
    """0/1 padding masks: all ones, left, right and random padding."""
    rows = torch.arange(batch)[:, None]
    cols = torch.arange(nk)[None, :]
    pad = 2 + (rows * 5) % max(1, nk // 2)
    trials = [torch.ones(batch, nk, dtype=torch.bool), cols >= pad, cols < nk - pad,
              torch.rand(batch, nk, generator=generator) < 0.7]
    return [t.to(device=device, dtype=dtype) for t in trials]


def _other_values_trial(batch: int, nk: int, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """A padding mask with zeros and nonzero values other than 1: negative, fractional, large, inf and NaN."""
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        values = [-1.0, 2.0, 0.5, -0.5, 1e-3, -7.0, info.max, info.min, info.tiny, float("inf"), float("-inf"),
                  float("nan")]
    else:
        info = torch.iinfo(dtype)
        values = [v for v in (-1, 2, -2, 3, 7, 255, -128, 2**31 - 1, -2**31, 2**40) if info.min <= v <= info.max]
        values += [info.max, info.min]
    picks = torch.randint(0, len(values), (batch, nk), generator=generator)
    out = torch.tensor(values, dtype=torch.float64 if dtype.is_floating_point else torch.int64)[picks].to(dtype)
    zero = torch.rand(batch, nk, generator=generator) < 0.3
    out = out.masked_fill(zero, 0)
    out[:, -1] = values[0]  # at least one key that only the value -1 makes valid
    return out.to(device)


def _classification_padding(batch: int, nk: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The same pattern of zeros and ones at every length: a padding mask's values do not grow with it."""
    rows = torch.arange(batch)[:, None]
    cols = torch.arange(nk)[None, :]
    return ((cols % 5 != 2) | (rows % 2 == 1)).to(device=device, dtype=dtype)


# -- which padding values the mask is proven for ----------------------------------------------------------------
_TRANSPARENT = {"view", "reshape", "expand", "expand_as", "view_as", "reshape_as", "unsqueeze", "squeeze", "permute",
                "transpose", "t", "contiguous", "clone", "detach", "flatten", "narrow", "select", "repeat",
                "__getitem__", "getitem", "movedim", "broadcast_to", "cpu", "cuda", "_add_batch_dim"}
_LOGICAL = {"logical_and", "logical_or", "logical_xor", "logical_not", "bool"}
_ZERO_TESTS = {"ne", "eq", "__ne__", "__eq__", "not_equal"}


def _name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")


def _nodes_in(x: Any) -> list:
    found: list = []
    fx.node.map_arg(x, found.append)
    return found


def _reads_only_nonzero(nodes: set, padding: fx.Node) -> bool:
    """Whether the slice reads the padding's values only through ``x != 0`` (``bool()``, ``to(torch.bool)``,
    ``== 0``, logical ops), after views and gathers that copy values unchanged. Then the mask cannot tell 2 or -1
    from 1, and a proof for 0/1 values holds for all values; otherwise it holds for 0/1 values only."""
    frontier = [padding]
    while frontier:
        src = frontier.pop()
        for user in src.users:
            if user not in nodes or _is_size_query(user):
                continue
            name = _name(user)
            first, rest = (user.args[0] if user.args else None), list(user.args[1:]) + list(user.kwargs.values())
            reads_as_data = first is src and src not in _nodes_in(rest)  # the data operand, not an index
            if name in _LOGICAL:
                continue  # truthiness of every operand: a function of x != 0
            if name in ("to", "type") and reads_as_data and (torch.bool in rest):
                continue
            if name in _ZERO_TESTS and len(user.args) == 2 and not user.kwargs:
                other = user.args[1] if first is src else first
                if (first is src or user.args[1] is src) and isinstance(other, (int, float)) \
                        and not isinstance(other, bool) and other == 0:
                    continue
            if name == "to" and reads_as_data and all(isinstance(r, (torch.device, str)) for r in rest) \
                    and set(user.kwargs) <= {"device"}:
                frontier.append(user)  # a move between devices
                continue
            if name in _TRANSPARENT and reads_as_data:
                frontier.append(user)
                continue
            return False
    return True


# -- which constants the mask depends on, and the lengths past which none of them changes it ------------------------
# ops whose operands are not compared with each other: factories (their size arguments shape the result, their fill
# value is its value), shape and dtype changes, selections (``where``: the values picked are not compared), global
# state. Their outputs are still classified, and their uses downstream still counted.
_NO_COMPARISON = {
    "full", "zeros", "ones", "empty", "full_like", "zeros_like", "ones_like", "empty_like", "new_full", "new_zeros",
    "new_ones", "new_empty", "tensor", "scalar_tensor", "as_tensor",
    "view", "reshape", "expand", "expand_as", "view_as", "reshape_as", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "flatten", "unflatten", "movedim", "contiguous", "clone", "detach", "to", "type", "type_as", "float",
    "half", "double", "bfloat16", "bool", "long", "int", "short", "byte", "char", "repeat", "tile", "broadcast_to",
    "cpu", "cuda", "item", "sym_float", "sym_int",
    "where", "masked_fill", "masked_fill_", "index_put", "index_put_", "masked_scatter", "masked_scatter_",
    "_add_batch_dim", "_remove_batch_dim", "_wrap_for_grad", "_unwrap_for_grad",
} | _BRACKET_NAMES
# ops whose numeric arguments after the first are positions along an index (a diagonal, a slice bound, a shift): a
# constant there changes the mask where an index reaches it
_INDEXING = {"triu", "tril", "triu_", "tril_", "diagonal", "diag", "diag_embed", "narrow", "select", "roll", "eye",
             "getitem", "__getitem__", "setitem", "__setitem__", "index_select", "tril_indices", "triu_indices"}
# ops whose integer arguments after the first are dimensions
_DIMS = {"sum", "any", "all", "amax", "amin", "max", "min", "mean", "prod", "cumsum", "cumprod", "cummax", "cummin",
         "argmax", "argmin", "logsumexp", "softmax", "log_softmax", "flip", "unbind", "count_nonzero", "nansum",
         "cat", "concat", "concatenate", "stack", "split", "chunk", "sort", "argsort", "std", "var", "norm"}
# multiplications and true divisions: a scale, not a threshold
_SCALING = {"mul", "mul_", "__mul__", "__rmul__", "imul", "multiply", "truediv", "__truediv__", "__rtruediv__",
            "itruediv", "div", "div_", "true_divide", "neg", "__neg__"}
_DIM_KWARGS = {"dim", "dims", "keepdim", "dtype", "descending", "stable"}


def _plain(x: torch.Tensor) -> torch.Tensor:
    """The tensor under vmap's wrappers (a mask built by nested vmaps): every lane's values."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(x):
        x = functorch.get_unwrapped(x)
    return x


def _summary(x: Any) -> Optional[tuple]:
    """(min, max, max |finite value|, has NaN) of a number or a tensor's values; None for anything else."""
    if isinstance(x, bool) or not isinstance(x, (int, float, torch.Tensor)):
        return None
    if not isinstance(x, torch.Tensor):
        v = float(x)
        if v != v:
            return (0.0, 0.0, 0.0, True)
        return (v, v, abs(v) if math.isfinite(v) else 0.0, False)
    x = _plain(x).detach()
    if x.is_complex():
        raise _Unsupported("the mask computes with complex values")
    if x.numel() == 0:
        return None
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    nan = False
    if x.is_floating_point():
        isnan = x.isnan()
        nan = bool(isnan.any())
        x = x[~isnan] if nan else x
        if x.numel() == 0:
            return (0.0, 0.0, 0.0, True)
        finite = x[x.isfinite()]
        largest = float(finite.abs().max()) if finite.numel() else 0.0
        return (float(x.min()), float(x.max()), largest, nan)
    lo, hi = float(x.min()), float(x.max())
    return (lo, hi, max(abs(lo), abs(hi)), False)


def _numbers(x: Any, out: list) -> list:
    """Tensors and non-bool numbers in a (nested) argument, in order."""
    if isinstance(x, (tuple, list)):
        for i in x:
            _numbers(i, out)
    elif isinstance(x, slice):
        _numbers((x.start, x.stop, x.step), out)
    elif isinstance(x, dict):
        _numbers(list(x.values()), out)
    elif isinstance(x, torch.Tensor) or (isinstance(x, (int, float)) and not isinstance(x, bool)):
        out.append(x)
    return out


def _operands(node: fx.Node, args: tuple, kwargs: dict) -> list:
    """What a call's threshold depends on: ``("value", summary)`` for operands compared with each other,
    ``("index", summary)`` for scalars that are positions along an index."""
    name = _name(node)
    if name in _NO_COMPARISON:
        return []
    if name in _INDEXING:
        rest = _numbers(list(args[1:]) + list(kwargs.values()), [])
        return [("index", _summary(x)) for x in rest if not isinstance(x, torch.Tensor)]
    if name in _SCALING and not kwargs.get("rounding_mode"):
        return [("scale", _summary(x)) for x in _numbers([args, kwargs], [])]
    if name in _DIMS:
        args = (args[0],) + tuple(a for a in args[1:] if isinstance(a, torch.Tensor)) if args else args
        kwargs = {k: v for k, v in kwargs.items() if k not in _DIM_KWARGS}
    return [("value", _summary(x)) for x in _numbers([args, kwargs], [])]


@dataclass(frozen=True)
class _Bite:
    """Where a constant can change the mask: about ``length`` tokens (inf: cannot be bounded)."""

    length: float
    node: str
    constant: float
    why: str = ""  # why it cannot be bounded


def _bites(ops_a: dict, ops_b: dict, n_a: int, n_b: int) -> list:
    """Compare the operands of each call at lengths ``n_a`` and ``n_b``. An operand whose values change with the
    length is length-dependent; one whose values do not is a constant. A call that combines both can change
    behaviour where an end of the length-dependent operand's range meets a constant's value (found by following
    each end linearly from the two measurements). Positions along an index (a diagonal, a slice bound) bite at
    themselves. Scaling by one constant changes no behaviour (the scaled slope is measured where it is compared);
    scaling by a constant that holds several values gives elements that grow at different rates: not bounded."""
    out = []
    for node, entries_a in ops_a.items():
        entries_b = ops_b.get(node)
        if entries_b is None or len(entries_b) != len(entries_a):
            out.append(_Bite(math.inf, node.name, math.nan))  # its operands change structure with the length
            continue
        constants, moving = [], []
        role = None
        for (role, a), (_, b) in zip(entries_a, entries_b):
            if a is None and b is None:
                continue
            same = a is not None and b is not None and (a[0], a[1], a[3]) == (b[0], b[1], b[3])
            if role == "index":
                magnitude = math.inf if (a is None or a[3]) else max(abs(a[0]), abs(a[1]))
                if same:
                    out.append(_Bite(magnitude, node.name, magnitude))
                continue
            if same:
                constants.append(a)
            else:
                moving.append((a, b))
        if not (constants and moving):
            continue
        magnitude = max((math.inf if c[3] else max(abs(c[0]), abs(c[1])) for c in constants), default=0.0)
        if role == "scale":
            if any(c[0] != c[1] or c[3] for c in constants):
                out.append(_Bite(math.inf, node.name, magnitude, "it scales a length-dependent value by a constant "
                                 "holding several values (elements that grow at different rates)"))
            continue
        out.append(_Bite(_crossing(constants, moving, n_a, n_b - n_a), node.name, magnitude))
    return out


def _crossing(constants: list, moving: list, n_a: int, delta: int) -> float:
    """The largest length at which an end of a moving range meets a constant's extreme value; inf when unbounded."""
    values = []
    for c in constants:
        if c[3] or not (math.isfinite(c[0]) and math.isfinite(c[1])):
            return math.inf  # NaN or an infinity next to a length-dependent value
        values += [c[0], c[1]]
    worst = 0.0
    for a, b in moving:
        if a is None or b is None or a[3] or b[3]:
            return math.inf
        ends = ((a[0], b[0]), (a[1], b[1]))
        if not all(math.isfinite(x) for end in ends for x in end) or all(x == y for x, y in ends):
            return math.inf  # no finite growth to follow (values change inside a fixed range)
        for at_a, at_b in ends:
            slope = (at_b - at_a) / delta
            if slope:
                worst = max([worst] + [n_a + (v - at_a) / slope for v in values])
    return worst


# -- the lengths the graph runs at ----------------------------------------------------------------------------------
@dataclass
class _Space:
    """The lengths the graph can run at, and the sizes of an evaluation at one of them."""

    static: bool
    exact: bool  # static and small: evaluated at the traced sizes themselves, nothing substituted
    nq: Any
    nk: Any
    batch: int
    base: dict  # symbols that are not lengths -> their traced value
    q_symbol: Any = None
    prefix_symbols: set = field(default_factory=set)  # kv_len's symbols other than q_len's (a cached prefix)
    tied: set = field(default_factory=set)  # symbols that take kv_len's value
    aliases: dict = field(default_factory=dict)  # symbol -> the expression of lengths it equals (_prefix_aliases)
    ranges: dict = field(default_factory=dict)  # symbol -> (lowest, highest) value the shape guards allow
    # symbols read by value that size nothing (a sliding cache's count of tokens seen: the queries' first position)
    # -> the lower bounds the shape guards give them; each point tries the lowest value, one above it, and ``n``
    # above it (``n``: the reach, so that a constant they meet is a bite)
    offsets: dict = field(default_factory=dict)
    guards: tuple = ()  # the shape guards over these symbols only: a point where one is false never runs
    # a static chunk over a symbolic cache (chunked prefill): q_len is the int nq at every call, and a length n is
    # the cached prefix, kv_len = nq + n, reached by giving kv_len's one symbol the value n + chunk_offset
    chunk_offset: Optional[int] = None

    def _chunk_symbol_value(self, n: int) -> int:
        return n + self.chunk_offset

    def allows(self, n: int, prefix: int) -> bool:
        if self.chunk_offset is not None:
            value = self._chunk_symbol_value(n)
            return n >= 0 and all(lo <= value <= hi for lo, hi in
                                  (self.ranges.get(s, (2, math.inf)) for s in self.prefix_symbols))
        if self.static:
            return True
        lo, hi = self.ranges.get(self.q_symbol, (2, math.inf))
        if not lo <= n <= hi:
            return False
        return all(lo <= prefix <= hi for lo, hi in (self.ranges.get(s, (2, math.inf)) for s in self.prefix_symbols))

    def point(self, n: int, prefix: int, extra: Optional[int] = None) -> tuple:
        """(sizes, batch, q_len, kv_len) with ``n`` queries (and a cached prefix of ``prefix`` keys); for a static
        chunk, ``n`` cached keys before the chunk's queries. Offsets take their lowest value plus ``extra``
        (default ``n``)."""
        if self.chunk_offset is not None:
            symbols = dict(self.base)
            for s in self.prefix_symbols:
                symbols[s] = self._chunk_symbol_value(n)
            sizes = _Sizes(symbols=symbols)
        elif self.exact:
            sizes = _Sizes(symbols=dict(self.base))
        elif self.static:
            sizes = _Sizes(symbols=dict(self.base), literals={self.nq + d: n + d for d in range(-2, 3)})
        else:
            symbols = dict(self.base)
            symbols[self.q_symbol] = n
            for s in self.prefix_symbols:
                symbols[s] = prefix
            sizes = _Sizes(symbols=symbols)
        for alias, value in self.aliases.items():
            sizes.symbols[alias] = int(value.xreplace(sizes.symbols))
        n_q, n_k = sizes.value(self.nq), sizes.value(self.nk)
        for symbol in self.tied:
            sizes.symbols[symbol] = n_k
        for symbol, bounds in self.offsets.items():
            try:
                lowest = max(int(bound.xreplace(sizes.symbols)) for bound in bounds)
            except (TypeError, ValueError) as exc:  # a bound that does not evaluate to a number
                raise _Unsupported(f"the size {symbol} has no lowest value at these lengths ({exc})") from exc
            sizes.symbols[symbol] = lowest + (n if extra is None else extra)
        if n_k < n_q:
            raise _Unsupported(f"kv_len {self.nk} can be shorter than q_len {self.nq}")
        return sizes, self.batch, n_q, n_k

    def extras(self, n: int) -> tuple:
        """The offsets' values above their lowest that each point is checked at."""
        return tuple(sorted({0, 1, n})) if self.offsets else (None,)

    def admits(self, sizes: _Sizes) -> bool:
        """Whether no shape guard over the evaluated symbols is false at ``sizes`` (undecided: admitted)."""
        for guard in self.guards:
            try:
                value = guard.xreplace({s: sympy.Integer(v) for s, v in sizes.symbols.items()})
            except Exception:  # noqa: BLE001 - a guard sympy cannot evaluate: the point stays
                continue
            if value is sympy.false:
                return False
        return True

    def keys_at(self, n: int) -> int:
        """The largest length (queries or keys) an evaluation at ``n`` runs at."""
        if self.exact:  # n moves the offsets only
            return self.nk
        return self.nq + n if self.chunk_offset is not None else n

    def elements(self, n: int) -> int:
        if self.exact:
            return self.batch * self.nq * self.nk
        if self.chunk_offset is not None:
            return self.batch * self.nq * (self.nq + n)
        return self.batch * n * (n + (n if self.prefix_symbols else 0))


def _prefix_aliases(mask_keys: Any, nk: Any, lengths: set, guards: list) -> dict:
    """{a: e} where the mask's key dim is kv_len with one symbol a that is not a length, e an expression of the
    lengths that a equals wherever the graph runs. A mask built once per forward from one layer's cache
    (transformers reads layer 0's length) meets a later layer whose keys Dynamo sized from that layer's own cache:
    ``s53 + s81`` keys in the mask, ``s66 + s81`` in k. A sliding cache sizes its mask ``window - 1 + q_len``
    while k is ``cached + q_len``: ``s9 + s81 - 1`` against ``s53 + s81``, ``s9 = s53 + 1``. SDPA takes a mask
    whose key dim is kv_len (or 1, which ``a + q_len >= 2`` rules out for a bare symbol), and Dynamo guards the
    equality it traced (``Eq(s81 + s9 - 1, s53 + s81)``), required here for any other form: an evaluation gives
    ``a`` that value."""
    if not isinstance(mask_keys, torch.SymInt) or not isinstance(nk, torch.SymInt):
        return {}
    others = _symbols(mask_keys) - lengths
    if len(others) != 1:
        return {}
    alias = next(iter(others))
    difference = sympy.expand(mask_keys.node.expr - nk.node.expr)
    slope = difference.diff(alias)
    if slope not in (1, -1):
        return {}
    value = sympy.expand(alias - difference / slope)  # the value of alias at which difference is 0
    if alias in value.free_symbols or not value.free_symbols <= lengths:
        return {}
    bare = isinstance(value, sympy.Symbol) and value in _symbols(nk) - _symbols(mask_keys)
    guarded = any(isinstance(g, sympy.Eq) and sympy.expand(g.lhs - g.rhs - difference) * sympy.expand(
        g.lhs - g.rhs + difference) == 0 for g in guards)
    return {alias: value} if bare or guarded else {}


def _lower_bounds(symbol, guards: list, known: set, ranges: dict) -> list:
    """Expressions of ``known`` symbols that the shape guards put ``symbol`` at or above (``s67 >= s9``: s9), from
    the guards that relate it linearly to them; its range's lower end if finite. Empty: nothing bounds it below."""
    bounds = []
    lo = ranges.get(symbol)
    if lo is not None and math.isfinite(lo):
        bounds.append(sympy.Integer(int(lo)))
    for guard in guards:
        if not isinstance(guard, (sympy.Ge, sympy.Gt, sympy.Le, sympy.Lt, sympy.Eq)):
            continue
        if symbol not in guard.free_symbols or not guard.free_symbols <= known | {symbol}:
            continue
        try:
            difference = sympy.expand(guard.lhs - guard.rhs)  # the guard: difference >= 0, > 0, <= 0, < 0 or == 0
            slope = difference.diff(symbol)
        except Exception:  # noqa: BLE001 - a guard with functions sympy cannot differentiate: no bound from it
            continue
        if not slope.is_Integer or slope == 0:
            continue
        rest = sympy.expand(difference - slope * symbol)
        if symbol in rest.free_symbols:
            continue
        sign = -1 if isinstance(guard, (sympy.Le, sympy.Lt)) else 1
        if isinstance(guard, sympy.Eq):
            sign = 1 if slope > 0 else -1
        elif sign * slope < 0:
            continue  # an upper bound: a point past it fails the guards and is skipped
        least = 1 if isinstance(guard, (sympy.Gt, sympy.Lt)) else 0  # sign * difference >= least
        bounds.append(sympy.ceiling((least - sign * rest) / (sign * slope)))
    return bounds


def _guards(shape_env) -> list:
    """The shape guards Dynamo installs for the graph, in the symbols the graph's sizes use (a guard recorded before
    Dynamo replaced a symbol with an equal expression, ``s9 -> s53 + 1``, is read after the replacement)."""
    if shape_env is None:
        return []
    replacements = dict(getattr(shape_env, "replacements", {}))
    out = []
    for guard in getattr(shape_env, "guards", ()):
        try:
            out.append(guard.expr.xreplace(replacements) if replacements else guard.expr)
        except Exception:  # noqa: BLE001 - a guard that cannot be rewritten is not used
            continue
    return [g for g in out if isinstance(g, sympy.Basic) and not isinstance(g, sympy.logic.boolalg.BooleanAtom)]


def _space(nodes: set, q: torch.Tensor, k: torch.Tensor, tied_to_keys: set, mask_keys: Any = None) -> _Space:
    nq, nk = q.shape[-2], k.shape[-2]
    if not isinstance(nq, int) and isinstance(nk, int):
        raise _Unsupported("q_len is symbolic and kv_len static: mask not analysed")
    shape_env = None
    all_symbols: set = set()
    for x in (*q.shape, *k.shape):
        all_symbols |= _symbols(x)
        if isinstance(x, torch.SymInt):
            shape_env = x.node.shape_env
    for node in nodes:
        value = example_value(node)
        sizes = ([value] if isinstance(value, torch.SymInt)
                 else list(value.shape) if isinstance(value, torch.Tensor) else [])
        for d in sizes:
            all_symbols |= _symbols(d)
            if shape_env is None and isinstance(d, torch.SymInt):
                # static q/k with a dynamic size elsewhere in the slice (a dynamic batch): its values live there
                shape_env = d.node.shape_env
    length_symbols = _symbols(nq) | _symbols(nk) | set(tied_to_keys)
    guards = _guards(shape_env)
    aliases = _prefix_aliases(mask_keys, nk, length_symbols, guards)
    length_symbols |= set(aliases)
    offsets: dict = {}
    batch_guess = q.shape[0] if isinstance(q.shape[0], int) else 1
    static_long = isinstance(nq, int) and isinstance(nk, int) and batch_guess * nq * nk > EXACT_ELEMENTS
    if not static_long:  # a long static mask substitutes literals for lengths: its offsets stay at their values
        ranges_of = {s: _bound(r.lower, -math.inf) for s, r in getattr(shape_env, "var_to_range", {}).items()}
        for s in all_symbols - length_symbols - _shape_symbols(nodes, q, k):
            bounds = _lower_bounds(s, guards, length_symbols, ranges_of)
            if bounds:
                offsets[s] = bounds
    evaluated = length_symbols | set(offsets)
    checks = tuple(g for g in guards if g.free_symbols and g.free_symbols <= evaluated)
    base: dict = {}
    for s in all_symbols - evaluated:
        hint = _hint(s, shape_env)
        if hint is None:
            raise _Unsupported(f"no example value for the size {s}")
        base[s] = hint
    batch_traced = q.shape[0]
    batch = batch_traced if isinstance(batch_traced, int) else _Sizes(symbols=base).value(batch_traced)
    if isinstance(nq, int) and not isinstance(nk, int):
        return _chunk_space(nq, nk, batch, base, shape_env, tied_to_keys, aliases, offsets, checks)
    if isinstance(nq, int):
        if nq > nk:
            raise _Unsupported(f"static q_len {nq} > kv_len {nk}: mask not analysed")
        if batch * nq * nk <= EXACT_ELEMENTS:
            return _Space(static=True, exact=True, nq=nq, nk=nk, batch=batch, base=base, offsets=offsets,
                          guards=checks)
        if nq != nk:
            raise _Unsupported(f"static q_len {nq} != kv_len {nk} (prefill with a cache): mask not analysed")
        if batch in {nq + d for d in range(-2, 3)}:
            raise _Unsupported(f"batch {batch} is within 2 of the sequence length: sizes are ambiguous")
        return _Space(static=True, exact=False, nq=nq, nk=nk, batch=batch, base=base)
    q_syms = _symbols(nq)
    if len(q_syms) != 1 or nq.node.expr != next(iter(q_syms)):
        raise _Unsupported(f"q_len {nq} is not a single size symbol: mask not analysed")
    ranges = {}
    for s in length_symbols:
        lo, hi = 2, math.inf
        value_range = getattr(shape_env, "var_to_range", {}).get(s) if shape_env is not None else None
        if value_range is not None:
            lo, hi = max(lo, _bound(value_range.lower, 2)), _bound(value_range.upper, math.inf)
        ranges[s] = (lo, hi)
    return _Space(static=False, exact=False, nq=nq, nk=nk, batch=batch, base=base, q_symbol=next(iter(q_syms)),
                  prefix_symbols=_symbols(nk) - q_syms - set(tied_to_keys), tied=set(tied_to_keys), ranges=ranges,
                  aliases=aliases, offsets=offsets, guards=checks)


def _shape_symbols(nodes: set, q: torch.Tensor, k: torch.Tensor) -> set:
    """The symbols in the shape of q, k or a tensor of the slice."""
    found: set = set()
    values = [q, k] + [example_value(node) for node in nodes]
    for value in values:
        if isinstance(value, torch.Tensor):
            for d in value.shape:
                found |= _symbols(d)
    return found


def _chunk_space(nq: int, nk: Any, batch: int, base: dict, shape_env, tied_to_keys: set,
                 aliases: dict, offsets: dict, guards: tuple) -> _Space:
    """A static chunk of ``nq`` queries over ``nk`` keys, one symbol ``s`` plus a constant (``s + c``: a cache
    that grows between calls): every length the graph runs at is ``nq`` queries after some cached prefix."""
    symbols = _symbols(nk)
    if len(symbols) != 1:
        raise _Unsupported(f"kv_len {nk} of a static chunk is not one size symbol plus a constant: mask not analysed")
    symbol = next(iter(symbols))
    at_zero = int(nk.node.expr.xreplace({symbol: 0}))
    if int(nk.node.expr.xreplace({symbol: 10})) - at_zero != 10:
        raise _Unsupported(f"kv_len {nk} of a static chunk does not grow one key per unit of {symbol}: mask not "
                           "analysed")
    lo, hi = 2, math.inf
    value_range = getattr(shape_env, "var_to_range", {}).get(symbol) if shape_env is not None else None
    if value_range is not None:
        lo, hi = max(lo, _bound(value_range.lower, 2)), _bound(value_range.upper, math.inf)
    ranges = {symbol: (lo, hi)}
    for tied in tied_to_keys:
        ranges[tied] = (2, math.inf)
    return _Space(static=False, exact=False, nq=nq, nk=nk, batch=batch, base=base, prefix_symbols={symbol},
                  tied=set(tied_to_keys), ranges=ranges, chunk_offset=nq - at_zero, aliases=aliases, offsets=offsets,
                  guards=guards)


def _bound(value: Any, default: float) -> float:
    """A shape guard's bound as a number (infinite bounds and anything unexpected: ``default``)."""
    try:
        number = float(value)
    except Exception:  # noqa: BLE001 - sympy's infinities and symbolic bounds
        return default
    return number if math.isfinite(number) else default


def _check_other_sizes(ordered: list, others: set) -> None:
    """Sizes that are not lengths (a dynamic batch) keep their traced value in every evaluation, so they may shape
    the mask but not decide its pattern: read by value, they may only count rows (``arange``) that index a tensor.
    Raises _Unsupported otherwise."""
    if not others:
        return
    indexes: set = set()  # arange(batch) and its views: allowed where they select rows
    for node in ordered:
        if node.op in ("placeholder", "get_attr") and not isinstance(example_value(node), torch.SymInt):
            continue
        if isinstance(example_value(node), torch.SymInt):
            continue  # a size, or arithmetic on sizes: checked where it is used
        reads = [a for a in node.all_input_nodes if isinstance(example_value(a), torch.SymInt)
                 and _symbols(example_value(a)) & others]
        name = _name(node)
        if reads:
            if name in _NO_COMPARISON or name in ("arange", "getitem", "__getitem__") or _is_size_query(node):
                if name == "arange":
                    indexes.add(node)
                continue
            raise _Unsupported(f"the mask computes with the size {example_value(reads[0])} ({node.name}), "
                               "which is not a length and is evaluated only at its traced value")
        used = [a for a in node.all_input_nodes if a in indexes]
        if not used:
            continue
        if name in ("getitem", "__getitem__", "index") and node.args and node.args[0] not in used:
            continue  # rows selected by it (aten.index: the vmapped indexing of transformers 4.53-4.57)
        if name in _NO_COMPARISON or name in ("getitem", "__getitem__"):
            indexes.add(node)  # a view of it, or vmap's batching of it
            continue
        raise _Unsupported(f"the mask computes with arange of a size that is not a length ({node.name}), evaluated "
                           "only at its traced value")


def _odd(x: float) -> int:
    n = int(math.ceil(x))
    return n if n % 2 else n + 1


def _reach(gm: fx.GraphModule, ordered: list, mask: fx.Node, space: _Space, inputs_for,
           first: int = FIRST_LENGTH) -> tuple:
    """(n_a, n_b, bites): two lengths past every constant the mask depends on, found by evaluating the slice at two
    lengths (from ``first``), measuring each call's bites, and moving both lengths past twice the largest until none
    is beyond."""
    n_a = first
    for _ in range(MAX_ROUNDS):
        n_b = n_a + LENGTH_STEP
        if space.keys_at(n_b) > MAX_EVAL_LENGTH or space.elements(n_b) > MAX_EVAL_ELEMENTS:
            raise _Unsupported(f"proving it would evaluate the mask at {n_b} tokens (limit {MAX_EVAL_LENGTH} tokens, "
                               f"{MAX_EVAL_ELEMENTS} elements)")
        if not (space.allows(n_a, n_a) and space.allows(n_b, n_b)):
            raise _Unsupported(f"the shape guards do not allow evaluating the mask at {n_a} and {n_b} tokens")
        observed = []
        for n in (n_a, n_b):
            ops: dict = {}
            sizes, batch, n_q, n_k = space.point(n, n)
            if not space.admits(sizes):
                raise _Unsupported(f"the shape guards do not allow evaluating the mask at {n} tokens")
            try:
                _evaluate(gm, ordered, mask, sizes, inputs_for(batch, n_q, n_k, None),
                          observe=lambda node, args, kwargs: ops.__setitem__(node, _operands(node, args, kwargs)))
            except _Unsupported:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means "not proven"
                raise _Unsupported(f"not a causal mask: at {n_q} tokens it could not be evaluated "
                                   f"({type(exc).__name__}: {str(exc)[:120]})") from exc
            observed.append(ops)
        bites = _bites(observed[0], observed[1], n_a, n_b)
        worst = max(bites, key=lambda b: b.length, default=None)
        if worst is None or n_a >= REACH_FACTOR * worst.length + REACH_MARGIN:
            return n_a, n_b, bites
        if not math.isfinite(worst.length):
            what = "" if math.isnan(worst.constant) else f" {worst.constant:g}"
            why = worst.why or (f"it combines a length-dependent value with a value{what} that the proof cannot "
                                "relate to a length")
            raise _Unsupported(f"cannot bound where {worst.node} changes the mask: {why}")
        n_a = _odd(REACH_FACTOR * worst.length + REACH_MARGIN)
        if space.keys_at(n_a + LENGTH_STEP) > MAX_EVAL_LENGTH or space.elements(n_a + LENGTH_STEP) > MAX_EVAL_ELEMENTS:
            raise _Unsupported(f"the mask depends on the constant {worst.constant:g} ({worst.node}, about "
                               f"{worst.length:.0f} tokens); proving it would evaluate the mask at {n_a} tokens "
                               f"(limit {MAX_EVAL_LENGTH} tokens, {MAX_EVAL_ELEMENTS} elements)")
    raise _Unsupported("the lengths past every constant of the mask did not settle")


def _points(gm: fx.GraphModule, ordered: list, mask: fx.Node, space: _Space, inputs_for,
            local: Local = CAUSAL) -> list:
    """Every (sizes, batch, q_len, kv_len) the mask is checked at; ``local``'s window and chunk are bites too (the
    expected mask changes where they start to matter, and the lengths past every bite are past them)."""
    if space.exact and not space.offsets:
        return [space.point(space.nq, 0)]
    if space.exact:  # the traced sizes at every offset: n is the offsets' value above their lowest
        n_a, n_b, bites = _reach(gm, ordered, mask, space, inputs_for, FIRST_LENGTH)
        extras = {0, 1, 2, 3, n_a, n_b} | {int(b.length) + d for b in bites if b.length < n_a for d in range(-2, 4)}
        points = [space.point(space.nq, 0, extra) for extra in sorted(e for e in extras if e >= 0)]
        return [p for p in points if space.admits(p[0])]
    widths = [w for w in (local.window, local.chunk) if w]
    first = max([FIRST_LENGTH] + [_odd(REACH_FACTOR * w + REACH_MARGIN) for w in widths])
    n_a, n_b, bites = _reach(gm, ordered, mask, space, inputs_for, first)
    bites = bites + [_Bite(float(w), "the window" if w == local.window else "the chunk size", float(w))
                     for w in widths]
    if space.chunk_offset is not None:  # n is the cached prefix: where the first and last query reach a width
        bites += [_Bite(float(w - d), "the local width", float(w)) for w in widths for d in (0, space.nq)
                  if w - d > 0]
    if space.static:
        if space.nq < n_a:  # the traced length is not past every constant: a substituted length proves nothing
            raise _Unsupported(f"static length {space.nq} is too long to evaluate the mask at and within reach of "
                               f"its constants (it would have to be at least {n_a})")
        return [space.point(n, n) for n in (n_a, n_b)]
    # below the constants the mask can differ at every length where one of them starts to bite: check each of those
    lengths = set(SMALL_LENGTHS) | {n_a, n_b}
    for bite in bites:
        if bite.length < n_a:
            lengths |= {int(bite.length) + d for d in range(-2, 4)}
    if space.chunk_offset is not None:  # n is the cached prefix: none at all too, and a single key
        wanted = [(n, n, extra) for n in sorted(lengths | {0, 1}) if space.allows(n, n) for extra in space.extras(n)]
    else:
        wanted = [(n, prefix, extra) for n in sorted(lengths) if n >= 2
                  for prefix in ((SMALL_PREFIX, n) if space.prefix_symbols else (0,)) if space.allows(n, prefix)
                  for extra in space.extras(n)]
    points = [space.point(*w) for w in wanted]
    return [p for p in points if space.admits(p[0])]


def analyse_mask(gm: fx.GraphModule, site: fx.Node, mask: fx.Node, q: torch.Tensor,
                 k: torch.Tensor) -> Union[MaskMatch, NotProven]:
    """Prove that ``mask`` (the ``attn_mask`` of the attention call ``site``) is causal, or causal AND padding."""
    if mask.op == "placeholder":
        return NotProven(f"the mask is graph input {mask.name}, read by value: a mask the caller passes in")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = _slice(mask, site, order)
    if site in nodes:
        return NotProven("the mask depends on the attention call itself")
    nq, nk = q.shape[-2], k.shape[-2]
    padding = positions = None
    for node in sorted((n for n in nodes if n.op == "placeholder"), key=order.get):
        value = example_value(node)
        if not isinstance(value, torch.Tensor):
            continue  # a SymInt: a size
        if not any(user in nodes and not _is_size_query(user) for user in node.users):
            continue  # read by size only
        if value.dim() == 1 and not value.is_floating_point() and _same(value.shape[0], nq) and positions is None:
            positions = node
        elif value.dim() == 2 and padding is None and (_same(value.shape[1], nk) or _tied(value.shape[1], nk)):
            padding = node
        else:
            return NotProven(f"the mask reads graph input {node.name} (shape {tuple(value.shape)}) by value, "
                             "which is neither a (batch, kv_len) padding mask nor the query positions")
    ordered = sorted(nodes, key=order.get)
    proven = _prove(gm, ordered, nodes, mask, q, k, padding, positions)
    if isinstance(proven, NotProven) and padding is not None and positions is None and _same(nq, nk):
        # a (batch, n) integer input may be position ids, read for the documents packed in each row
        dtype = example_value(padding).dtype
        if not dtype.is_floating_point and dtype != torch.bool:
            documents = _prove(gm, ordered, nodes, mask, q, k, None, None, documents=padding)
            if isinstance(documents, MaskMatch):
                return documents
    return proven


def _prove(gm: fx.GraphModule, ordered: list, nodes: set, mask: fx.Node, q: torch.Tensor, k: torch.Tensor,
           padding: Optional[fx.Node], positions: Optional[fx.Node],
           documents: Optional[fx.Node] = None) -> Union[MaskMatch, NotProven]:
    device = example_value(mask).device
    pad_dtype = example_value(padding).dtype if padding is not None else None
    nk = k.shape[-2]

    def inputs_for(batch: int, n_q: int, n_k: int, trial: Optional[torch.Tensor]) -> dict:
        inputs: dict = {}
        if positions is not None:
            inputs[positions] = torch.arange(n_k - n_q, n_k, device=device, dtype=example_value(positions).dtype)
        if padding is not None:
            inputs[padding] = trial if trial is not None else _classification_padding(batch, n_k, pad_dtype, device)
        if documents is not None:  # one document, its positions growing with the length, unless a trial's
            dtype = example_value(documents).dtype
            inputs[documents] = trial if trial is not None else torch.arange(n_k, device=device, dtype=dtype).expand(
                batch, n_k).contiguous()
        return inputs

    try:
        read = padding if padding is not None else documents
        tied = _symbols(example_value(read).shape[1]) if read is not None else set()
        mask_value = example_value(mask)
        mask_keys = mask_value.shape[-1] if isinstance(mask_value, torch.Tensor) and mask_value.dim() else None
        space = _space(nodes, q, k, tied - _symbols(nk), mask_keys)
        _check_other_sizes(ordered, set(space.base))
        points = _points(gm, ordered, mask, space, inputs_for)
        local = CAUSAL
        if documents is None:
            local = _infer_local(gm, ordered, mask, points, pad_dtype, inputs_for)
            if not local.is_causal:  # its widths are bites of the expected mask: checked around and past them too
                points = _points(gm, ordered, mask, space, inputs_for, local)
    except _Unsupported as exc:
        return NotProven(str(exc))
    # 0/1 padding values must give the causal & padding mask; other values only where the mask reads nothing but
    # "nonzero" from the padding (else the op refuses them at run time: binary_padding)
    binary = padding is not None and pad_dtype != torch.bool and not _reads_only_nonzero(nodes, padding)
    generator = torch.Generator().manual_seed(0)
    for sizes, batch, n_q, n_k in points:
        trials = [None]
        if padding is not None:
            trials = _padding_trials(batch, n_k, pad_dtype, device, generator)
        if documents is not None:
            trials = _document_trials(batch, n_k, example_value(documents).dtype, device, generator)
        if padding is not None and pad_dtype != torch.bool and not binary:
            trials.append(_other_values_trial(batch, n_k, pad_dtype, device, generator))
        for number, trial in enumerate(trials):
            try:
                value = _evaluate(gm, ordered, mask, sizes, inputs_for(batch, n_q, n_k, trial))
                problem = (_compare(value, batch, n_q, n_k, None, documents=trial) if documents is not None else
                           _compare(value, batch, n_q, n_k, trial, local=local))
            except Exception as exc:  # noqa: BLE001 - any failure means "not proven"
                problem = f"could not be evaluated ({type(exc).__name__}: {str(exc)[:120]})"
            if problem and number == 4 and padding is not None:
                binary = True  # values other than 0/1 read differently than the structure suggested: 0/1 only
            elif problem:
                what = "" if trial is None else " with packed documents" if documents is not None else \
                    " with a padding mask"
                structure = "causal" if local.is_causal else f"causal AND {local.describe()}"
                return NotProven(f"not a {structure}{' & key-padding' if padding is not None else ''} mask: at "
                                 f"{n_q} tokens{what} it {problem}")
    return MaskMatch(key_padding=padding, query_positions=positions, nodes=frozenset(nodes), binary_padding=binary,
                     documents=documents, local=local)


def _infer_local(gm: fx.GraphModule, ordered: list, mask: fx.Node, points: list, pad_dtype,
                 inputs_for) -> Local:
    """The window and chunk size the mask restricts causal attention to, read from its values with every key valid
    (batch row 0, head 0): first at the longest point (past every bite), then, where that shows one, from every
    point (a chunk size is the gcd of where chunks start: a short static chunk of queries may see one chunk only),
    the simplest that fits every point's rows.
    A guess only: the proof is the comparison at every point that follows; anything else (not causal, not
    contiguous, heads that differ) is left to that comparison to report."""
    device = example_value(mask).device

    def rows_at(point) -> Optional[tuple]:
        sizes, batch, n_q, n_k = point
        trial = None if pad_dtype is None else torch.ones(batch, n_k, dtype=pad_dtype, device=device)
        try:
            keep = _keep_4d(_evaluate(gm, ordered, mask, sizes, inputs_for(batch, n_q, n_k, trial)), n_q, n_k)
        except Exception:  # noqa: BLE001 - the comparison reports it
            return None
        if isinstance(keep, str):
            return None
        keep = keep[0, 0].cpu()  # one row's pattern, read on the host
        qpos, keys = torch.arange(n_k - n_q, n_k), torch.arange(n_k)
        lo = torch.where(keep, keys, n_k).amin(-1)
        hi = torch.where(keep, keys, -1).amax(-1)
        if not bool(((hi == qpos) & (keep.sum(-1) == hi - lo + 1)).all()):
            return None  # not causal with one contiguous range per row: no window to read
        return qpos, lo

    longest = max(points, key=lambda p: (p[3], p[2]))
    rows = rows_at(longest)
    if rows is None or not bool(rows[1].any()):
        return CAUSAL
    everywhere = [r for r in (rows_at(p) for p in points if p is not longest) if r is not None] + [rows]
    window = max(int((qpos - lo + 1).max()) for qpos, lo in everywhere)
    reach = max(int((qpos - lo).max()) for qpos, lo in everywhere)
    chunk = alone = 0  # where rows' keys start (chunks alone); where rows see themselves only (chunks AND a window)
    for qpos, lo in everywhere:
        for start in lo.unique().tolist():
            chunk = math.gcd(chunk, int(start))
        for start in qpos[(lo == qpos) & (qpos > 0)].tolist():
            alone = math.gcd(alone, int(start))
    candidates = [Local(window=window)]
    if chunk > reach:
        candidates.append(Local(chunk=chunk))
    if alone > 1:
        candidates += [Local(chunk=alone), Local(window=window, chunk=alone)]

    def fits(candidate: Local) -> bool:
        for qpos, lo in everywhere:
            keys = torch.arange(int(qpos[-1]) + 1)  # the queries are the last keys
            if not bool((torch.where(candidate.visible(qpos, keys), keys, len(keys)).amin(-1) == lo).all()):
                return False
        return True

    return next((candidate for candidate in candidates if fits(candidate)), CAUSAL)


def _tied(a: Any, b: Any) -> bool:
    """Both sizes symbolic: a padding mask's length that Dynamo traced as its own symbol (the op checks at run time
    that it equals kv_len); the evaluation gives it kv_len's value."""
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and len(_symbols(a)) == 1 \
        and a.node.expr == next(iter(_symbols(a)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return str(a) == str(b)
    return a == b


def _keep_4d(value: Any, nq: int, nk: int) -> Union[torch.Tensor, str]:
    """The entries a mask value keeps as (B or 1, H or 1, nq, nk) bool, or what is wrong with it."""
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3, 4):
        return f"is not a 2-D to 4-D tensor ({type(value).__name__})"
    if tuple(value.shape[-2:]) != (nq, nk):
        return f"has shape {tuple(value.shape)}, not (..., {nq}, {nk})"
    keep = _keep(value)
    if keep is None:
        return "holds values other than 0 and the masked value (a bias, not a mask)"
    keep = keep.reshape(-1 if keep.dim() == 2 else keep.shape[0], *keep.shape[-3 if keep.dim() == 4 else -2:])
    return keep[:, None] if keep.dim() == 3 else keep


def _compare(value: Any, batch: int, nq: int, nk: int, padding: Optional[torch.Tensor],
             documents: Optional[torch.Tensor] = None, local: Local = CAUSAL) -> Optional[str]:
    keep = _keep_4d(value, nq, nk)
    if isinstance(keep, str):
        return keep
    if keep.shape[0] not in (1, batch):
        return f"has batch {keep.shape[0]}, expected {batch}"
    expected = _expected(batch, nq, nk, padding, keep.device, documents, local)[:, None]  # (B, 1, nq, nk)
    compared = expected.any(-1, keepdim=True)  # rows with no visible key are undefined everywhere
    differs = (keep != expected) & compared
    if bool(differs.any()):
        b, h, i, j = (int(x) for x in differs.nonzero()[0])
        got = "keeps" if bool(keep.expand_as(differs)[b, h, i, j]) else "masks"
        return f"{got} key {j} for query {i} (batch {b}, head {h})"
    return None


# -- after the rewrite: what the graph no longer needs ---------------------------------------------------------
def is_input_view(node: fx.Node) -> bool:
    """Whether ``node`` is a graph input seen through views and dtype conversions only (a mask the op can check at
    run time)."""
    while True:
        if node.op == "placeholder":
            return True
        if not ((node.op == "call_method" and node.target in _VIEW_METHODS)
                or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)):
            return False
        if not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]


def mutated_inputs(graph: fx.Graph) -> set:
    """The graph inputs that some node of ``graph`` writes in place, through a view or directly."""
    return {root for node in graph.nodes if _is_mutation(node) and node.args and isinstance(node.args[0], fx.Node)
            for root in [_root(node.args[0])] if root.op == "placeholder"}


def input_of(node: fx.Node) -> Optional[fx.Node]:
    """The graph input ``node`` views (through views and dtype conversions), or None."""
    root = _root(node)
    return root if root.op == "placeholder" else None


def proof_holds_at(match: MaskMatch, site: fx.Node) -> bool:
    """Whether a proof made for an earlier site holds at ``site``: no mutation of the mask's tensors in between."""
    roots = {_root(n) for n in match.nodes}
    seen = False
    for node in site.graph.nodes:
        if node is site:
            return True
        if node in match.nodes:
            seen = True
        elif seen and _is_mutation(node) and isinstance(node.args[0], fx.Node) and _root(node.args[0]) in roots:
            return False
    return True


def removable_nodes(gm: fx.GraphModule, candidates: set) -> list:
    """Nodes of ``candidates`` (mask slices whose masks are no longer used) that nothing else needs, in reverse
    graph order, ready to erase. A mutation goes with the tensor it mutates; the bracketing global-state calls
    go only when everything between them goes."""
    removable = {n for n in candidates if n.op not in ("placeholder", "get_attr", "output")}
    brackets = {n for n in removable if _is_bracket(n)}
    removable -= brackets
    changed = True
    while changed:
        changed = False
        for node in list(removable):
            keep = any(user not in removable for user in node.users)
            if _is_mutation(node) and isinstance(node.args[0], fx.Node):
                keep = keep or _root(node.args[0]) not in removable
            if keep:
                removable.discard(node)
                changed = True
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for first, last, members in sorted(_bracket_regions(nodes, brackets), key=lambda r: r[1] - r[0]):
        inside = [n for n in nodes[first + 1:last] if n.op != "placeholder" and n not in members]
        dead = set(removable)
        for node in reversed(inside):  # nodes nothing reads (traced but unused) go with the bracket too
            if node not in dead and not _is_mutation(node) and not _is_bracket(node) \
                    and all(u in dead for u in node.users):
                dead.add(node)
        if all(n in dead for n in inside):
            removable = dead | set(members)
    return sorted(removable, key=order.get, reverse=True)


def _bracket_regions(nodes: list, brackets: set) -> list:
    """(first, last, members) of each matched bracket among ``brackets``: vmap nesting levels (with the
    decomposition loads before them) and autocast enter/exit pairs. Unmatched calls form no region: they stay."""
    index = {n: i for i, n in enumerate(nodes)}
    regions, stack, pending = [], [], []
    for node in nodes:
        if node not in brackets:
            continue
        name = getattr(node.target, "__name__", "")
        if name == "lazy_load_decompositions":
            pending.append(node)
        elif name == "_vmap_increment_nesting":
            stack.append(pending + [node])
            pending = []
        elif name == "_vmap_decrement_nesting" and stack:
            regions.append(stack.pop() + [node])
        elif name == "_exit_autocast" and node.args and node.args[0] in brackets:
            regions.append([node.args[0], node])
    return [(min(index[m] for m in members), max(index[m] for m in members), members) for members in regions]


# -- repeat_kv --------------------------------------------------------------------------------------------------
def undo_repeat_kv(node: Any) -> Optional[tuple]:
    """If ``node`` repeats a (B, Hkv, N, D) tensor to (B, Hkv*r, N, D) with head h reading head h // r (transformers'
    ``repeat_kv``: ``x[:, :, None]`` -> ``expand`` -> ``reshape`` [-> ``contiguous``], or ``repeat_interleave``
    on dim 1), return ``(x, r, chain)`` with ``chain`` the repeating nodes; else None."""
    if not isinstance(node, fx.Node):
        return None
    chain = [node]
    while node.op == "call_method" and node.target == "contiguous":
        node = node.args[0]
        chain.append(node)
    out = example_value(node)
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        return None
    if _is_call(node, "repeat_interleave"):
        source = node.args[0]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        x = example_value(source)
        if (isinstance(source, fx.Node) and isinstance(repeats, int) and dim in (1, -3)
                and isinstance(x, torch.Tensor) and x.dim() == 4):
            return source, repeats, tuple(chain)
        return None
    if not (_is_call(node, "reshape") or _is_call(node, "view")):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, fx.Node) and _is_call(expanded, "expand")):
        return None
    five = example_value(expanded)
    if not isinstance(five, torch.Tensor) or five.dim() != 5:
        return None
    inserted = expanded.args[0]
    if not isinstance(inserted, fx.Node):
        return None
    source = _new_axis_source(inserted)
    if source is None:
        return None
    x = example_value(source)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return None
    b, h, n, d = x.shape
    r = five.shape[2]
    if not all(_same(a, c) for a, c in ((five.shape[0], b), (five.shape[1], h), (five.shape[3], n),
                                         (five.shape[4], d), (out.shape[0], b), (out.shape[2], n),
                                         (out.shape[3], d))):
        return None
    if not isinstance(r, int) or not _same(out.shape[1], h * r):
        return None
    return source, r, tuple(chain) + (expanded, inserted)


def _is_call(node: fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    if node.op == "call_function":
        return getattr(node.target, "__name__", "") == name
    return False


def _new_axis_source(node: fx.Node) -> Optional[fx.Node]:
    """``x`` when ``node`` is ``x[:, :, None]`` (a new axis at dim 2 of a 4-D tensor) or ``x.unsqueeze(2)``."""
    if node.op == "call_function" and node.target is operator.getitem:
        source, index = node.args
        if not isinstance(source, fx.Node) or not isinstance(index, tuple):
            return None
        full = slice(None, None, None)
        trimmed = list(index)
        while trimmed and (trimmed[-1] == full or trimmed[-1] is Ellipsis):
            trimmed.pop()
        if trimmed == [full, full, None]:
            return source
        return None
    if _is_call(node, "unsqueeze"):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim in (2, -3):
            return node.args[0]
    return None
