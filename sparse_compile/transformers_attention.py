"""transformers without torch.compile: the ``"sparse_prefill"`` attention implementation.

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sparse_prefill")
    model.set_attn_implementation("sparse_prefill")           # or switch a loaded model
    sparse_compile.enable_transformers_attention(model, SparseConfig(method="pbs"))   # and give it a configuration

``register()`` adds two functions under that name through transformers' public registration functions
(``AttentionInterface.register``, ``AttentionMaskInterface.register``). It runs at ``import sparse_compile`` when
transformers is already imported, at ``enable_transformers_attention()`` and when the backend compiles a graph;
importing ``sparse_compile`` never imports transformers and nothing watches imports: import transformers first, or
call ``enable_transformers_attention()``, before ``from_pretrained(..., attn_implementation="sparse_prefill")``.

* The mask function: for the plain causal, sliding-window and chunked causal masks it builds no ``q_len x kv_len``
  mask but returns ``None`` (a causal prefill, no padding) or the 2-D key-padding mask over the keys the queries see,
  noted with the window or chunk size (``local.Local``); every other pattern gets transformers' own 4-D SDPA mask
  and a note saying why it runs dense.
* The attention function: causal calls go through the compiled op's run-time decision (``pipeline.attend`` /
  ``pipeline.attend_causal``, a window or chunks through ``local=``); decode steps run dense; calls it cannot prove
  causal or that need what the sparse path lacks run transformers' SDPA function (the eager one where SDPA cannot
  serve them) with the mask they stand for, recorded dense with the reason.

A 2-D mask means "causal + padding" only when this module built it (each is noted by identity, weakly). Traced by
``torch.compile`` both are transformers' SDPA functions: ``backend="sparse_prefill"`` runs the graph sparse with the
compile's options, any other backend compiles plain SDPA. Which mask factories are read and how, the chunk and
padding limits and the full routing: docs/design.md ("The transformers front door").
"""

from __future__ import annotations

import copy
import functools
import re
import sys
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import report
from .config import SparseConfig
from .context import resolve
from .attention_op import in_output_layout
from .dense import DenseForm
from .local import CAUSAL, Local
from .padding import owned_mask, padding_layout
from .pipeline import DENSE, DOCUMENT, attend, attend_causal, attend_segments
from .rules import autocast_inputs
from .state import STATE, WITH_MODEL

__all__ = ["NAME", "MIN_TRANSFORMERS", "register", "enable_transformers_attention", "config_of", "site_of",
           "attention_forward", "mask_forward", "supports_version", "note_of", "CausalNote"]

NAME = "sparse_prefill"
MIN_TRANSFORMERS = (4, 53)  # AttentionInterface came in 4.51, AttentionMaskInterface (masking_utils) in 4.53
_MASK_MODULE = "transformers.masking_utils"


# -- versions and registration --------------------------------------------------------------------------------
def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def _installed_version() -> Optional[str]:
    module = sys.modules.get("transformers")
    return getattr(module, "__version__", None) if module is not None else None


def supports_version(version: Optional[str]) -> bool:
    return version is not None and _version_tuple(version) >= MIN_TRANSFORMERS


@STATE.cached("transformers_attention.entry", None, bound=2,
              kept="registered with transformers: one object per pair, so registering again changes nothing")
def _entry(function, traced):
    """``function`` as registered. Run eagerly it is ``function`` outside Dynamo's reach (a graph break under
    torch.compile would run it with the front door's configuration, not the compile's options). Traced by torch.compile
    it is ``traced``, transformers' own SDPA function: the compiled graph then holds plain SDPA calls, which
    ``backend="sparse_prefill"`` rewrites with its own options (one configuration in force, site names the graph's)
    and any other backend compiles as the ``"sdpa"`` implementation. One object per pair: registering again changes
    nothing."""
    eager = torch.compiler.disable(function)

    @functools.wraps(function)
    def entry(*args, **kwargs):
        if torch.compiler.is_compiling():
            return traced(*args, **kwargs)
        return eager(*args, **kwargs)

    return entry


def register() -> bool:
    """Register ``"sparse_prefill"`` through transformers' public registration functions
    (``AttentionInterface.register``, ``AttentionMaskInterface.register``) when transformers is imported and recent
    enough; True if it did. Does nothing unless transformers is imported; registering again is harmless."""
    if not supports_version(_installed_version()):
        return False
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, _entry(attention_forward, sdpa_attention_forward))
    AttentionMaskInterface.register(NAME, _entry(mask_forward, sdpa_mask))
    return True


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("sparse_compile.enable_transformers_attention: transformers is not installed") from exc
    if not supports_version(transformers.__version__):
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise RuntimeError(
            f"sparse_compile: the {NAME!r} attention implementation needs transformers >= {need} (its "
            f"AttentionInterface and AttentionMaskInterface); transformers {transformers.__version__} is installed. "
            f"Upgrade transformers, or use torch.compile(model, backend={NAME!r}), which supports this version."
        )
    register()
    return transformers


# -- per-model configuration and site names -------------------------------------------------------------------
_DEFAULT = STATE.value("transformers_attention.default", SparseConfig())
_CONFIGS: "weakref.WeakKeyDictionary[torch.nn.Module, SparseConfig]" = STATE.add(
    "transformers_attention.configs", weakref.WeakKeyDictionary(), kept=WITH_MODEL)
_SITES: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = STATE.add(
    "transformers_attention.sites", weakref.WeakKeyDictionary(), kept=WITH_MODEL)


def enable_transformers_attention(model=None, config: Optional[SparseConfig] = None):
    """Register ``"sparse_prefill"`` with transformers (``register``: after this call,
    ``from_pretrained(..., attn_implementation="sparse_prefill")`` works) and, given a model, switch it (and its
    sub-models) to it.

    ``config``: the ``SparseConfig`` its attention runs with (with a model: that model's; without: the default of
    every model that has none). ``sparsity(...)`` blocks apply on top, as for compiled models. Returns the model.
    Raises a ``RuntimeError`` naming the version needed on transformers older than 4.53.
    """
    transformers = _require_transformers()
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"enable_transformers_attention(config=...): must be a SparseConfig, got "
                        f"{type(config).__name__}")
    if model is None:
        if config is not None:
            _DEFAULT.value = config
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_transformers_attention(model=...): must be a transformers model (a "
                        f"torch.nn.Module), got {type(model).__name__}")
    _own_configs(model, transformers.PretrainedConfig)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        for module in model.modules():
            if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
                module.config._attn_implementation = NAME
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current != NAME:  # transformers declined (a model that does not call attention through its interface)
        raise ValueError(f"enable_transformers_attention: {type(model).__name__} kept attn_implementation "
                         f"{current!r}: it does not dispatch attention through transformers' AttentionInterface. "
                         f"Use torch.compile(model, backend={NAME!r}) for it.")
    _name_modules(model)
    if config is not None:
        for module in model.modules():
            _CONFIGS[module] = config
    return model


def _own_configs(model: torch.nn.Module, config_class: type) -> None:
    """Give ``model`` copies of the transformers configurations (``config_class``) its modules hold, so that
    switching its attention implementation does not change a configuration object the caller passed in and may
    build other models from (sharing between the model's modules kept: one copy per object)."""
    memo: dict = {}
    for module in model.modules():
        held = module.__dict__.get("config")
        if isinstance(held, config_class):
            module.config = copy.deepcopy(held, memo)


def _name_modules(root: torch.nn.Module) -> None:
    for name, module in root.named_modules():
        _SITES[module] = name


def _site_of(module: torch.nn.Module) -> str:
    """The attention layer's module path in the model the user called (as the compiled path names sites), found
    once per model from the calling frames; else ``layers.N`` from its ``layer_idx`` (``skip_layers`` reads the
    first integer between dots)."""
    site = _SITES.get(module)
    if site is not None:
        return site
    owners = []
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and owner is not module and owner not in owners:
            owners.append(owner)
        frame = frame.f_back
    for owner in reversed(owners):  # the outermost module holding this one: the model the user called
        if any(m is module for m in owner.modules()):
            _name_modules(owner)
            site = _SITES.get(module)
            if site:
                return site
    index = getattr(module, "layer_idx", None)
    site = f"layers.{index}" if isinstance(index, int) else type(module).__name__
    _SITES[module] = site
    return site


def _config_of(module: torch.nn.Module) -> SparseConfig:
    return _CONFIGS.get(module, _DEFAULT.value)


def config_of(module: Optional[torch.nn.Module]) -> SparseConfig:
    """The ``SparseConfig`` a module's attention runs with: the one ``enable_transformers_attention(model, config)``
    gave its model, else the default (``enable_transformers_attention(None, config)``); None: the default."""
    return _DEFAULT.value if module is None else _config_of(module)


def site_of(module: torch.nn.Module) -> str:
    """The attention layer's site name, as ``runtime_stats()`` and ``skip_layers`` see it (its module path)."""
    return _site_of(module)


# -- notes on the masks this module returns ---------------------------------------------------------------------
@dataclass(frozen=True)
class CausalNote:
    """A 2-D (batch, keys) key-padding mask: causal attention over those keys, queries at the last positions, AND
    ``local`` (a sliding window, chunks from each row's first valid key: ``local.py``)."""

    all_valid: bool  # known without reading the mask (built here as all ones)
    local: Local = CAUSAL


@dataclass(frozen=True)
class _Documents:
    """A (batch, n) tensor of document ids: documents packed in each row, each causal on its own."""


@dataclass(frozen=True)
class _Dense:
    """transformers' 4-D SDPA mask for a pattern the sparse path does not run."""

    reason: str


_NOTES: dict[int, tuple[weakref.ref, Any]] = STATE.add("transformers_attention.notes", {})


def _noted(tensor: Tensor, note) -> Tensor:
    key = id(tensor)

    def forget(ref, key=key):
        entry = _NOTES.get(key)
        if entry is not None and entry[0] is ref:
            _NOTES.pop(key, None)

    _NOTES[key] = (weakref.ref(tensor, forget), note)
    return tensor


def note_of(tensor: Tensor):
    entry = _NOTES.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1]


# -- the mask function --------------------------------------------------------------------------------------------
def _same_function(a, b, depth: int = 0) -> bool:
    """Built by the same factory with the same arguments: same code, equal closure contents (recursively)."""
    if a is b:
        return True
    if depth > 6:
        return False
    if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
        if a.__code__ is not b.__code__:
            return False
        cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
        try:
            return len(cells_a) == len(cells_b) and all(
                _same_function(x.cell_contents, y.cell_contents, depth + 1) for x, y in zip(cells_a, cells_b))
        except ValueError:  # an empty cell
            return False
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_function(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, (int, float, str)) and type(a) is type(b):
        return a == b
    return False


def _causal_pattern(masking, mask_function, local_size, q_last: int, kv_first: int) -> Optional[str]:
    """None when ``mask_function`` is causal for every query here, else why not."""
    if mask_function is masking.causal_mask_function:
        return None
    factory = getattr(masking, "sliding_window_causal_mask_function", None)
    if isinstance(local_size, int) and factory is not None and _same_function(mask_function, factory(local_size)):
        # the window keeps keys closer than local_size: it binds when the farthest causal pair is outside it
        if q_last - kv_first < local_size:
            return None
        return (f"sliding window {local_size} shorter than the {q_last - kv_first + 1} keys: not causal prefill "
                "(the window drops keys)")
    if mask_function is getattr(masking, "bidirectional_mask_function", None) or (
            getattr(mask_function, "__name__", "") == "bidirectional_mask_function"):
        return "bidirectional mask (encoder or bidirectional attention): not causal"
    if isinstance(local_size, int):
        return f"local attention pattern (size {local_size}): not causal prefill"
    return (f"mask pattern {getattr(mask_function, '__qualname__', mask_function)!r} is not plain causal "
            "(packed sequences, chunked attention or an overlay)")


def _local_pattern(masking, mask_function, local_size) -> Optional[tuple]:
    """``(Local, left_padding)`` when ``mask_function`` is transformers' sliding-window causal function
    (``sliding_window_causal_mask_function(local_size)``) or chunked causal function (``chunked_causal_mask_function``:
    ``left_padding`` the (batch,) first key of each row's chunks, None where this version counts chunks from key 0),
    else None. The factory is matched by its code; what it computes is read by evaluating it on a few rows, so a
    version whose window keeps one key more or less is read as it is, or not at all."""
    if not isinstance(local_size, int) or isinstance(local_size, bool) or local_size < 1:
        return None
    window = getattr(masking, "sliding_window_causal_mask_function", None)
    if window is not None and _same_function(mask_function, window(local_size)):
        local, left = Local(window=local_size), None
    else:
        chunked = getattr(masking, "chunked_causal_mask_function", None)
        left = _chunk_origin(masking, mask_function, chunked, local_size)
        if left is None:
            return None
        local, left = Local(chunk=local_size), (left if isinstance(left, Tensor) else None)
    # two rows past the width, relative to the first row's origin: what the function keeps there
    device = left.device if left is not None else torch.device("cpu")  # the indices beside what they index
    origin = int(left.reshape(-1)[0]) if left is not None else 0
    rows = torch.arange(2 * local_size, 2 * local_size + 2, device=device)
    keys = torch.arange(2 * local_size + 2, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    try:
        kept = torch.stack([mask_function(zero, zero, r + origin, keys + origin) for r in rows])
    except Exception:  # noqa: BLE001 - a version whose functions take other arguments: not read
        return None
    if not torch.equal(kept.to(torch.bool), local.visible(rows, keys)):
        return None
    return local, left


def _chunk_origin(masking, mask_function, factory, chunk_size: int):
    """The ``left_padding`` tensor of ``chunked_causal_mask_function(chunk_size, left_padding)`` (``True`` where this
    version's factory takes no left padding), else None."""
    if factory is None or not isinstance(mask_function, types.FunctionType) or not mask_function.__closure__:
        return None
    takes_padding = factory.__code__.co_argcount >= 2
    probe = factory(chunk_size, torch.zeros(1, dtype=torch.long)) if takes_padding else factory(chunk_size)
    if mask_function.__code__ is not probe.__code__:
        return None
    parts = mask_function.__closure__[0].cell_contents
    expected = probe.__closure__[0].cell_contents
    if not (isinstance(parts, tuple) and isinstance(expected, tuple) and len(parts) == len(expected) == 2):
        return None
    overlay, causal = parts
    if causal is not masking.causal_mask_function or not isinstance(overlay, types.FunctionType) or \
            overlay.__code__ is not expected[0].__code__:
        return None
    cells = dict(zip(overlay.__code__.co_freevars, (c.cell_contents for c in overlay.__closure__ or ())))
    if cells.get("chunk_size") != chunk_size:
        return None
    if not takes_padding:
        return True
    left = cells.get("left_padding")
    return left if isinstance(left, Tensor) and left.dim() == 1 else None


def _packed_documents(masking, mask_function) -> Optional[Tensor]:
    """The document ids of ``and_masks(causal_mask_function, packed_sequence_mask_function(ids))`` (how
    transformers masks documents packed in a row), else None."""
    factory = getattr(masking, "packed_sequence_mask_function", None)
    if factory is None or not isinstance(mask_function, types.FunctionType) or not mask_function.__closure__:
        return None
    parts = mask_function.__closure__[0].cell_contents
    if mask_function.__code__ is not masking.and_masks(masking.causal_mask_function).__code__ or \
            not isinstance(parts, tuple) or len(parts) != 2 or not _causal_in_documents(masking, parts[0]):
        return None
    packed = parts[1]
    probe = torch.zeros(1, 1, dtype=torch.int64)
    if not isinstance(packed, types.FunctionType) or packed.__code__ is not factory(probe).__code__:
        return None
    ids = packed.__closure__[0].cell_contents if packed.__closure__ else None
    return ids if isinstance(ids, Tensor) and ids.dim() == 2 else None


def _causal_in_documents(masking, function) -> bool:
    """The causal mask, or (5.x) the causal mask on the positions within each document: inside one document the
    positions are consecutive, so the two agree there."""
    if function is masking.causal_mask_function:
        return True
    remap = getattr(masking, "remap_positions_for_packed_sequence", None)
    if remap is None or not isinstance(function, types.FunctionType):
        return False
    probe = remap(masking.causal_mask_function, torch.zeros(1, 1, dtype=torch.int64))
    if function.__code__ is not probe.__code__:
        return False
    cells = dict(zip(function.__code__.co_freevars, (c.cell_contents for c in function.__closure__)))
    return cells.get("mask_function") is masking.causal_mask_function


def _query_positions(cache_position: Tensor) -> Optional[tuple[int, int]]:
    """(first, length) when ``cache_position`` is ``arange(first, first + length)``; one small host read."""
    n = cache_position.numel()
    if n == 0:
        return None
    flat = cache_position.reshape(-1)
    expected = torch.arange(n, device=flat.device, dtype=flat.dtype) + flat[0]
    first, contiguous = torch.stack([flat[0].to(torch.int64), (flat == expected).all().to(torch.int64)]).tolist()
    return (first, n) if contiguous else None


def mask_forward(batch_size: int, cache_position: Optional[Tensor] = None, kv_length: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[Tensor] = None, local_size: Optional[int] = None,
                 q_length: Optional[int] = None, q_offset=0, **kwargs):
    """transformers' mask interface for ``"sparse_prefill"`` (both signatures: ``cache_position`` before 5.0,
    ``q_length`` / ``q_offset`` since)."""
    masking = sys.modules[_MASK_MODULE]
    if mask_function is None:
        mask_function = masking.causal_mask_function
    everything = dict(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                      attention_mask=attention_mask, local_size=local_size, **kwargs)
    if q_length is not None:
        everything.update(q_length=q_length, q_offset=q_offset)
        if isinstance(q_offset, Tensor):  # a static cache's offset: one host read
            q_offset = int(q_offset.reshape(-1)[0])
        positions = (int(q_offset), int(q_length))
    else:
        everything.update(cache_position=cache_position)
        positions = _query_positions(cache_position) if cache_position is not None else None

    def dense(reason: str):
        built = masking.sdpa_mask(**{**everything, "allow_is_causal_skip": False,
                                     "allow_is_bidirectional_skip": False})
        if built is None:  # only a bidirectional pattern without padding is skipped: every key is visible
            q_len = positions[1] if positions is not None else cache_position.numel()
            built = torch.ones(batch_size, 1, q_len, kv_length, dtype=torch.bool,
                               device=kwargs.get("device", "cpu") if cache_position is None else cache_position.device)
        return _noted(built, _Dense(reason))

    if positions is None:
        return dense("query positions (cache_position) are not consecutive")
    first, q_len = positions
    documents = _packed_documents(masking, mask_function)
    if documents is not None and attention_mask is None and first == kv_offset == 0 and \
            q_len == kv_length == documents.shape[-1]:
        return _noted(documents, _Documents())  # each document on its own (attention_forward)
    found = _local_pattern(masking, mask_function, local_size)
    local, left = found if found is not None else (CAUSAL, None)
    why = None if found is not None else _causal_pattern(masking, mask_function, local_size, first + q_len - 1,
                                                         kv_offset)
    if why is not None:
        return dense(why)
    keys = first + q_len - kv_offset  # keys [kv_offset, first + q_len) can be seen; later cache slots cannot
    if not (q_len >= 1 and q_len <= keys <= kv_length):
        return dense(f"query positions [{first}, {first + q_len}) do not fit the {kv_length} keys at offset "
                     f"{kv_offset}")
    if isinstance(attention_mask, Tensor) and isinstance(note_of(attention_mask), CausalNote) and \
            tuple(attention_mask.shape) == (batch_size, keys):
        # this function's own mask passed back in (generate() builds a static cache's mask, the model's forward
        # builds it again from that): already over these keys, not a padding mask over positions 0..keys
        return attention_mask
    if local.window and first + q_len - 1 - kv_offset < local.window:
        local = CAUSAL  # the farthest causal pair is inside the window: it binds nowhere
    device = cache_position.device if cache_position is not None else kwargs.get("device", "cpu")
    padding = None
    if attention_mask is not None:
        padding = attention_mask.to(torch.bool)
        if padding.shape[-1] < kv_offset + keys:  # a static cache's slots past the tokens seen: padding
            padding = F.pad(padding, (0, kv_offset + keys - padding.shape[-1]))
        padding = padding[:, kv_offset:kv_offset + keys]
    if local.chunk:
        # keys before the first query's chunk are seen by no query: left out, so that each row's first valid key
        # is where its chunks start (a chunked cache keeps keys of the chunk before)
        origin = (left.to(device) if left is not None else torch.zeros(batch_size, dtype=torch.long, device=device))
        cut = origin + torch.div(first - origin, local.chunk, rounding_mode="floor") * local.chunk
        positions = kv_offset + torch.arange(keys, device=device)
        if bool((cut > kv_offset).any()):
            padding = (padding if padding is not None else torch.ones(batch_size, keys, dtype=torch.bool,
                                                                       device=device)) & (positions >= cut[:, None])
        problem = _chunk_problem(padding, left, local.chunk, kv_offset, keys, batch_size)
        if problem is not None:
            return dense(problem)
    if padding is None:
        if keys == q_len == kv_length and local.is_causal:
            return None  # a causal prefill without padding: no mask at all
        return _noted(torch.ones(batch_size, keys, dtype=torch.bool, device=device), CausalNote(True, local))
    # a fresh tensor per forward pass, which every layer receives: its padding summary is read once (padding.py);
    # contiguous, since generate() makes a static cache's masks contiguous and a copy would carry no note
    return _noted(owned_mask(padding.contiguous()), CausalNote(False, local))


def _chunk_problem(padding: Optional[Tensor], left: Optional[Tensor], chunk: int, kv_offset: int, keys: int,
                   batch: int) -> Optional[str]:
    """None when every row's chunks start at its first valid key among the keys seen (what the sparse path counts
    from), as transformers counts them (from ``left``, each row's left padding, or key 0); else why not. One small
    host read."""
    positions = torch.arange(keys, device=padding.device if padding is not None else "cpu")
    first = (torch.where(padding, positions, keys).amin(-1) if padding is not None
             else torch.zeros(batch, dtype=torch.long)) + kv_offset
    origin = left.to(first.device) if left is not None else torch.zeros_like(first)
    empty = first >= kv_offset + keys
    if bool((((first - origin) % chunk != 0) & ~empty).any()):
        return (f"chunks of {chunk} counted from key {origin.tolist()} (transformers' left padding), not from each "
                f"row's first valid key among the keys at offset {kv_offset}: dense with the mask")
    return None


# -- the attention function ---------------------------------------------------------------------------------------
def _unsupported(dropout, kwargs) -> tuple[Optional[str], bool]:
    """(why this call needs the dense delegate, whether SDPA cannot serve it: the model's eager function must)."""
    if kwargs.get("softcap") is not None:
        return f"attention logit soft-capping ({kwargs['softcap']})", True
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return "attention sinks", True
    if kwargs.get("position_bias") is not None:
        return "a position bias added to the scores", False
    if dropout:
        return f"dropout {dropout} (training)", False
    return None, False


def _attend_documents(module, query: Tensor, key: Tensor, value: Tensor, ids: Tensor, scaling, site: str) -> Tensor:
    """Each document of each row on its own (``pipeline.attend_segments``); ``(B, N, Hq, D)``."""
    config = resolve(_config_of(module)).for_site(site)
    query, key, value = autocast_inputs(query, key, value)
    changes = torch.diff(ids, dim=-1) != 0
    starts = changes.nonzero().tolist()  # one host read
    rows: list = [[0] for _ in range(ids.shape[0])]
    for row, at in starts:
        rows[row].append(at + 1)
    out = [attend_segments(query[b:b + 1], key[b:b + 1], value[b:b + 1], scaling, config, site,
                           tuple((a, e, a, e) for a, e in zip(row, row[1:] + [ids.shape[-1]])),
                           note=f"; {DOCUMENT}") for b, row in enumerate(rows)]
    return in_output_layout(torch.cat(out)).transpose(1, 2)


def _document_mask(ids: Tensor, q_len: int, kv_len: int) -> Tensor:
    """The 4-D boolean mask of documents packed in a row: causal within each document."""
    positions = torch.arange(kv_len, device=ids.device)
    causal = positions[None, :] <= positions[kv_len - q_len:, None]
    same = ids[:, kv_len - q_len:, None] == ids[:, None, :]
    return (causal[None] & same)[:, None]


def _full_mask(mask: Tensor, q_len: int, kv_len: int, local: Local = CAUSAL) -> Tensor:
    """The 4-D boolean mask a noted 2-D mask stands for (AND ``local``, chunks from each row's first valid key),
    over all ``kv_len`` keys (for the dense delegate)."""
    keys = mask.shape[-1]
    query_pos = torch.arange(keys - q_len, keys, device=mask.device)
    key_pos = torch.arange(kv_len, device=mask.device)
    first = torch.where(mask, key_pos[:keys], keys).amin(-1)[:, None] if local.chunk else 0
    seen = local.visible(query_pos - first, key_pos - first)  # (q_len, kv_len), or (B, q_len, kv_len)
    padding = F.pad(mask, (0, kv_len - keys)) if kv_len > keys else mask
    return (seen if seen.dim() == 3 else seen[None])[:, None] & padding[:, None, None, :]


def _delegate(module, query, key, value, mask, dropout, scaling, is_causal, kwargs, site, reason, eager):
    """transformers' own path, recorded dense with the reason. ``mask`` is already what SDPA takes (or None)."""
    report.record_call(site, DENSE, reason, tuple(query.shape))
    function = None
    if eager:
        function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is not None:
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.where(mask, torch.zeros((), dtype=query.dtype, device=mask.device),
                               torch.finfo(query.dtype).min)
        return function(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention interface for ``"sparse_prefill"``: q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)``
    (GQA kept, never repeated); returns ``((B, Nq, Hq, D), None)`` as transformers' SDPA function does."""
    site = _site_of(module)
    if kwargs.get("output_attentions"):  # as transformers' SDPA function says it
        warnings.warn(f"the {NAME!r} attention implementation does not return attention weights "
                      "(output_attentions=True): set attn_implementation='eager' to get them", UserWarning,
                      stacklevel=2)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    feature, eager = _unsupported(dropout, kwargs)
    note = note_of(attention_mask) if isinstance(attention_mask, Tensor) else None

    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            return _delegate(module, query, key, value, None, dropout, scaling, is_causal, kwargs, site,
                             "not causal (is_causal=False): encoder, bidirectional or cross-attention", eager)
        if 1 < q_len != kv_len:  # not a mask this module returns: SDPA's own reading of it decides
            return _delegate(module, query, key, value, None, dropout, scaling, is_causal, kwargs, site,
                             f"no mask and q_len {q_len} != kv_len {kv_len}: query positions unknown", eager)
        keys, padding = kv_len, None
    elif isinstance(note, _Documents) and feature is None and attention_mask.shape == (query.shape[0], kv_len) \
            and q_len == kv_len:
        return _attend_documents(module, query, key, value, attention_mask, scaling, site), None
    elif isinstance(note, CausalNote):
        keys, padding = attention_mask.shape[-1], (None if note.all_valid else attention_mask)
        if keys > kv_len or keys < q_len or attention_mask.shape[0] != query.shape[0]:
            raise ValueError(f"sparse_compile ({site}): a {tuple(attention_mask.shape)} padding mask does not fit "
                             f"q {tuple(query.shape)} and k {tuple(key.shape)}")
    elif isinstance(note, _Documents):  # what the sparse path lacks, or shapes it was not built for: their mask
        mask = _document_mask(attention_mask, q_len, kv_len)
        return _delegate(module, query, key, value, mask, dropout, scaling, False, kwargs, site,
                         feature or "documents packed in a row, at shapes the mask was not built for", eager)
    else:
        reason = note.reason if isinstance(note, _Dense) else (
            f"a {attention_mask.dim()}-D attention_mask not built by the {NAME!r} mask function (e.g. one the caller "
            "passed): its pattern is unknown")
        return _delegate(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs, site,
                         reason, eager)

    local = note.local if isinstance(note, CausalNote) and note.local.binds(keys) else CAUSAL
    window = kwargs.get("sliding_window")
    if feature is None and isinstance(window, int) and keys > window and local.window != window:
        # the model says its layer has a window its mask does not: the mask is not this layer's
        feature = f"sliding window {window} shorter than the {keys} keys: not causal prefill (the window drops keys)"
    if feature is not None:
        # the model's eager function applies no causal rule of its own: it needs the mask its mask function builds
        # (SDPA takes is_causal instead where no key is padded, the queries are all the keys and nothing is local)
        as_sdpa = not eager and padding is None and keys == kv_len == q_len and local.is_causal
        mask = None if as_sdpa else _full_mask(
            attention_mask if padding is not None else query.new_ones(query.shape[0], keys, dtype=torch.bool),
            q_len, kv_len, local)
        return _delegate(module, query, key, value, mask, dropout, scaling, is_causal if mask is None else False,
                         kwargs, site, feature, eager)

    config = resolve(_config_of(module)).for_site(site)
    query, key, value = autocast_inputs(query, key, value)  # as transformers' SDPA call would run under autocast
    k, v = (key, value) if keys == kv_len else (key[:, :, :keys], value[:, :, :keys])
    gqa = query.shape[1] != k.shape[1]
    if padding is not None and q_len == 1:  # decode: one query sees every valid key (in its window); (B, 1, 1, N)
        mask = padding[:, None, None, :] if local.is_causal else _full_mask(padding, 1, keys, local)
        out = attend(query, k, v, scaling, config, site, DenseForm(enable_gqa=gqa, mask=mask))
    else:
        layout = None if padding is None else padding_layout(padding, keys)
        out = attend_causal(query, k, v, scaling, config, site, layout, local=local)
    return in_output_layout(out).transpose(1, 2), None
