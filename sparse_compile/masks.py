"""Recognising the attention masks that models build inside a traced graph.

Under Dynamo, transformers cannot look at mask values, so it materialises the mask in the graph: an additive float
mask built with ``full``/``triu`` and in-place updates (4.46-4.52), a bool mask built by nested functorch vmaps
(4.53-4.57) or by broadcasting aranges (5.x). The constructions differ by version; what they compute does not. So
instead of matching each construction, ``analyse_mask`` proves what a mask *is*:

1. Take the backward slice of the mask node. Size queries (``x.size(1)``, ``x.shape``) are leaves evaluated from
   the traced shapes, so the slice never reaches the model's activations. In-place mutations of the slice's
   tensors or of their views (``setitem``, ``mul_``, ``*=``) are part of the slice even though they are not
   ancestors of the mask node, and so are the global-state calls that bracket it (vmap nesting, autocast).
2. See which graph inputs the slice reads by value. Allowed: none (the mask is a function of sizes and constants),
   one ``(batch, kv_len)`` tensor (a tokenizer's ``attention_mask``) and one ``(q_len,)`` integer tensor
   (``cache_position``, which ``generate`` passes in; it is checked to be the canonical positions at run time).
3. Evaluate the slice at small substituted lengths (symbolic sizes and static literals alike) and compare with
   the causal mask, ``key j visible to query i iff j <= i + kv_len - q_len``, and with the causal mask AND the key
   padding for ones, left, right and random padding. A bool mask keeps True; a float mask keeps 0 and masks
   values at or below ``finfo.min / 2``. Query rows that see no key under the expected mask are not compared:
   every implementation leaves them undefined (transformers even unmasks them on CUDA).
4. Integer constants of the slice that are not sizes (a sliding window) decide the evaluation lengths: the slice
   is also evaluated past the largest one, so a window that bites at the real length bites in the evaluation.

Anything not proven comes back as ``NotProven`` with a reason naming what could not be shown.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx

__all__ = ["MaskMatch", "NotProven", "analyse_mask", "removable_nodes", "undo_repeat_kv"]

# evaluation lengths: odd, unaligned with any block size; a third one past the largest non-size constant
TRIAL_LENGTHS = (19, 37, 53, 71)
MIN_STATIC_LENGTH = 16  # static literals below this are too ambiguous to substitute
MAX_EVAL_LENGTH = 8192
MAX_EVAL_ELEMENTS = 1 << 28
LARGE_CONSTANT = 8  # integer literals above this that are not sizes can change the mask with the length

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

    @property
    def reason(self) -> str:
        what = "causal mask" if self.key_padding is None else "causal mask AND key padding"
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


def _example(node: Any):
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
        if node.target in _INPLACE_OPERATORS or "out" in node.kwargs:
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


def _inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes]


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
            start.extend(_inputs(node))

    add(stack)
    while True:
        roots = {_root(n) for n in nodes}
        extra = [m for m in mutations if m not in nodes and isinstance(m.args[0], fx.Node) and _root(m.args[0]) in roots]
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


def _literal_ints(nodes: set) -> set:
    found: set = set()

    def visit(x: Any) -> None:
        if isinstance(x, bool):
            return
        if isinstance(x, int):
            found.add(x)
        elif isinstance(x, (tuple, list)):
            for i in x:
                visit(i)
        elif isinstance(x, slice):
            visit(x.start), visit(x.stop), visit(x.step)
        elif isinstance(x, dict):
            for i in x.values():
                visit(i)

    for node in nodes:
        if node.op in ("call_function", "call_method"):
            visit(node.args)
            visit(node.kwargs)
    return found


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


def _evaluate(gm: fx.GraphModule, nodes: list, mask: fx.Node, sizes: _Sizes, inputs: dict) -> torch.Tensor:
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
                elif not isinstance(_example(node), torch.Tensor):
                    env[node] = sizes.value(_example(node))  # a SymInt input
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
    example = _example(node.args[0])
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


def _expected(batch: int, nq: int, nk: int, padding: Optional[torch.Tensor], device) -> torch.Tensor:
    qpos = torch.arange(nk - nq, nk, device=device)
    causal = torch.arange(nk, device=device)[None, :] <= qpos[:, None]  # (nq, nk)
    out = causal.expand(batch, nq, nk)
    if padding is not None:
        out = out & (padding != 0)[:, None, :]
    return out


def _padding_trials(batch: int, nk: int, dtype: torch.dtype, device, generator: torch.Generator) -> list:
    """ones, left, right and random padding, and (last) a random mask with a nonzero value other than 1."""
    def as_dtype(valid: torch.Tensor, value=1) -> torch.Tensor:
        if dtype == torch.bool:
            return valid
        return valid.to(dtype) * value

    rows = torch.arange(batch)[:, None]
    cols = torch.arange(nk)[None, :]
    pad = 2 + (rows * 5) % max(1, nk // 2)
    left = cols >= pad
    right = cols < nk - pad
    rand = torch.rand(batch, nk, generator=generator) < 0.7
    other = 2 if not dtype.is_floating_point else 0.5
    trials = [torch.ones(batch, nk, dtype=torch.bool), left, right, rand]
    out = [as_dtype(t) for t in trials]
    if dtype != torch.bool:
        out.append(as_dtype(torch.rand(batch, nk, generator=generator) < 0.6, other))
    return [t.to(device) for t in out]


def _batch_size(value: Any) -> Optional[int]:
    return value if isinstance(value, int) else None


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
        value = _example(node)
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
    try:
        tied = _symbols(_example(padding).shape[1]) if padding is not None else set()
        plan = _evaluation_plan(nodes, q, k, tied_to_keys=tied - _symbols(nk))
    except _Unsupported as exc:
        return NotProven(str(exc))
    ordered = sorted(nodes, key=order.get)
    generator = torch.Generator().manual_seed(0)
    binary = False
    device = _example(mask).device
    for sizes, batch, n_q, n_k in plan:
        inputs: dict = {}
        if positions is not None:
            inputs[positions] = torch.arange(n_k - n_q, n_k, device=device, dtype=_example(positions).dtype)
        trials = [None]
        if padding is not None:
            trials = _padding_trials(batch, n_k, _example(padding).dtype, device, generator)
        for number, trial in enumerate(trials):
            if trial is not None:
                inputs[padding] = trial
            try:
                value = _evaluate(gm, ordered, mask, sizes, inputs)
                problem = _compare(value, batch, n_q, n_k, trial)
            except Exception as exc:  # noqa: BLE001 - any failure means "not proven"
                problem = f"could not be evaluated ({type(exc).__name__}: {str(exc)[:120]})"
            if problem and trial is not None and number == len(trials) - 1 and number > 0:
                binary = True  # only the trial with a nonzero value other than 1 failed: proven for 0/1 masks
            elif problem:
                what = "" if trial is None else " with a padding mask"
                return NotProven(f"not a causal{' & key-padding' if padding is not None else ''} mask: at "
                                 f"{n_q} tokens{what} it {problem}")
    return MaskMatch(key_padding=padding, query_positions=positions, nodes=frozenset(nodes), binary_padding=binary)


def _tied(a: Any, b: Any) -> bool:
    """Both sizes symbolic: a padding mask's length that Dynamo traced as its own symbol (the op checks at run time
    that it equals kv_len); the evaluation gives it kv_len's value."""
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and len(_symbols(a)) == 1 \
        and a.node.expr == next(iter(_symbols(a)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return str(a) == str(b)
    return a == b


def _compare(value: Any, batch: int, nq: int, nk: int, padding: Optional[torch.Tensor]) -> Optional[str]:
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3, 4):
        return f"is not a 2-D to 4-D tensor ({type(value).__name__})"
    if tuple(value.shape[-2:]) != (nq, nk):
        return f"has shape {tuple(value.shape)}, not (..., {nq}, {nk})"
    keep = _keep(value)
    if keep is None:
        return "holds values other than 0 and the masked value (a bias, not a mask)"
    keep = keep.reshape(-1 if keep.dim() == 2 else keep.shape[0], *keep.shape[-3 if keep.dim() == 4 else -2:])
    if keep.dim() == 3:
        keep = keep[:, None]
    if keep.shape[0] not in (1, batch):
        return f"has batch {keep.shape[0]}, expected {batch}"
    expected = _expected(batch, nq, nk, padding, keep.device)[:, None]  # (B, 1, nq, nk)
    compared = expected.any(-1, keepdim=True)  # rows with no visible key are undefined everywhere
    differs = (keep != expected) & compared
    if bool(differs.any()):
        b, h, i, j = (int(x) for x in differs.nonzero()[0])
        got = "keeps" if bool(keep.expand_as(differs)[b, h, i, j]) else "masks"
        return f"{got} key {j} for query {i} (batch {b}, head {h})"
    return None


def _evaluation_plan(nodes: set, q: torch.Tensor, k: torch.Tensor, tied_to_keys: set = frozenset()) -> list:
    """(sizes, batch, q_len, kv_len) for each evaluation; raises _Unsupported with a reason. ``tied_to_keys``:
    symbols that take kv_len's value (a padding mask's own length symbol)."""
    nq, nk = q.shape[-2], k.shape[-2]
    batch_traced = q.shape[0]
    shape_env = None
    for x in (nq, nk, batch_traced):
        if isinstance(x, torch.SymInt):
            shape_env = x.node.shape_env
    literals = _literal_ints(nodes)
    static = isinstance(nq, int) and isinstance(nk, int)
    if isinstance(nq, int) != isinstance(nk, int):
        raise _Unsupported("q_len and kv_len are one static and one symbolic: mask not analysed")
    if static:
        if nq != nk:
            raise _Unsupported(f"static q_len {nq} != kv_len {nk} (prefill with a cache): mask not analysed")
        if nq < MIN_STATIC_LENGTH:
            raise _Unsupported(f"q_len {nq} < {MIN_STATIC_LENGTH} at compile time: too short to analyse the mask")
    # symbols that hold lengths are substituted; every other symbol keeps the value it was traced with
    length_symbols = _symbols(nq) | _symbols(nk) | set(tied_to_keys)
    base: dict = {}
    all_symbols: set = set()
    for node in nodes:
        value = _example(node)
        if isinstance(value, torch.SymInt):
            all_symbols |= _symbols(value)
        elif isinstance(value, torch.Tensor):
            for d in value.shape:
                all_symbols |= _symbols(d)
    for s in all_symbols - length_symbols:
        hint = _hint(s, shape_env)
        if hint is None:
            raise _Unsupported(f"no example value for the size {s}")
        base[s] = hint
    batch = batch_traced if isinstance(batch_traced, int) else _Sizes(symbols=base).value(batch_traced)
    size_literals = {nq + d for d in range(-2, 3)} if static else set()
    if static and batch in size_literals:
        raise _Unsupported(f"batch {batch} is within 2 of the sequence length: sizes are ambiguous")
    constants = sorted(abs(c) for c in literals - size_literals if abs(c) > LARGE_CONSTANT and c != batch)
    lengths = [n for n in TRIAL_LENGTHS if not ({n + d for d in range(-2, 3)} & {batch})][:2]
    real = nq if static else None
    if constants:
        largest = constants[-1]
        if real is None or real > largest - 32:
            extra = largest + 29 if real is None else min(real, largest + 29)
            if extra > MAX_EVAL_LENGTH or batch * extra * extra > MAX_EVAL_ELEMENTS:
                raise _Unsupported(f"the mask depends on the constant {largest}; proving it would evaluate the "
                                   f"mask at {extra} tokens")
            lengths.append(extra)
    plan = []
    for n in lengths:
        symbols = dict(base)
        if not static:
            q_syms = _symbols(nq)
            if len(q_syms) != 1 or nq.node.expr != next(iter(q_syms)):
                raise _Unsupported(f"q_len {nq} is not a single size symbol: mask not analysed")
            symbols[next(iter(q_syms))] = n
            for s in _symbols(nk) - q_syms:
                symbols[s] = 5  # a cached prefix of 5 tokens
        sizes = _Sizes(symbols=symbols, literals={nq + d: n + d for d in range(-2, 3)} if static else {})
        n_q, n_k = sizes.value(nq), sizes.value(nk)
        for symbol in tied_to_keys:
            sizes.symbols[symbol] = n_k
        if n_k < n_q:
            raise _Unsupported(f"kv_len {nk} can be shorter than q_len {nq}")
        plan.append((sizes, batch, n_q, n_k))
    return plan


# -- after the rewrite: what the graph no longer needs ---------------------------------------------------------
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
    out = _example(node)
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        return None
    if _is_call(node, "repeat_interleave"):
        source = node.args[0]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        x = _example(source)
        if (isinstance(source, fx.Node) and isinstance(repeats, int) and dim in (1, -3)
                and isinstance(x, torch.Tensor) and x.dim() == 4):
            return source, repeats, tuple(chain)
        return None
    if not (_is_call(node, "reshape") or _is_call(node, "view")):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, fx.Node) and _is_call(expanded, "expand")):
        return None
    five = _example(expanded)
    if not isinstance(five, torch.Tensor) or five.dim() != 5:
        return None
    inserted = expanded.args[0]
    if not isinstance(inserted, fx.Node):
        return None
    source = _new_axis_source(inserted)
    if source is None:
        return None
    x = _example(source)
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
