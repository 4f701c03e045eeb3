"""Configuration: one validated dataclass for the backend, one per method for its parameters.

Every method's defaults are its paper's defaults. Each method also documents the setting that keeps every
causal block (``keep_all_params``); with it the method computes exact dense attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

__all__ = [
    "SparseConfig",
    "PBSParams",
    "SpargeParams",
    "BFLAParams",
    "S2OParams",
    "XAttentionParams",
    "METHOD_NAMES",
    "KERNEL_NAMES",
    "PLANNER_NAMES",
]


def _fail(owner: str, name: str, problem: str) -> None:
    raise ValueError(f"{owner}.{name}: {problem}")


def _check_block(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 16 or value & (value - 1):
        _fail(owner, name, f"must be a power of two >= 16, got {value!r}")


def _check_fraction(owner: str, name: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (low <= value <= high):
        _fail(owner, name, f"must be a number in [{low}, {high}], got {value!r}")


def _check_int(owner: str, name: str, value: Any, *, low: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(owner, name, f"must be an integer >= {low}, got {value!r}")


class _Params:
    """Mixin: keyword construction from a mapping with a clear error for unknown keys."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def updated(self, overrides: Mapping[str, Any]):
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown parameter(s) {unknown}; valid: {list(self.field_names())}"
            )
        return dataclasses.replace(self, **dict(overrides))  # type: ignore[type-var]


@dataclass(frozen=True)
class PBSParams(_Params):
    """PBS-Attn (Wang et al. 2025): segmented query-aware key permutation + mean-pooling block selection.

    Defaults from the paper (Sec. 4.1): B=128, S=256, threshold 0.9. ``threshold=1.0`` keeps every causal block.
    """

    block_size: int = 128
    segment_size: int = 256
    threshold: float = 0.9
    keep_first_block: bool = True

    def __post_init__(self) -> None:
        _check_block("PBSParams", "block_size", self.block_size)
        _check_int("PBSParams", "segment_size", self.segment_size, low=1)
        if self.segment_size % self.block_size:
            _fail("PBSParams", "segment_size", f"must be a multiple of block_size={self.block_size}")
        _check_fraction("PBSParams", "threshold", self.threshold)


@dataclass(frozen=True)
class SpargeParams(_Params):
    """SpargeAttn (Zhang et al. 2025): mean-pool + self-similarity judge + TopCdf, and the P·V skip.

    The paper tunes (τ, θ, λ) per layer; these defaults are a fixed, conservative point.
    ``cdf_threshold=1.0, pv_threshold=None`` keeps every causal block and never skips P·V.
    ``pv_threshold`` is λ < 0 in natural-log units: the P·V product of a tile is skipped when every row's
    tile maximum is below its running maximum by more than |λ|.
    """

    block_size_q: int = 128
    block_size_kv: int = 64
    cdf_threshold: float = 0.98
    similarity_threshold: float = 0.6
    pv_threshold: float | None = -20.0

    def __post_init__(self) -> None:
        _check_block("SpargeParams", "block_size_q", self.block_size_q)
        _check_block("SpargeParams", "block_size_kv", self.block_size_kv)
        _check_fraction("SpargeParams", "cdf_threshold", self.cdf_threshold)
        _check_fraction("SpargeParams", "similarity_threshold", self.similarity_threshold, low=-1.0)
        if self.pv_threshold is not None and (
            not isinstance(self.pv_threshold, (int, float)) or not self.pv_threshold < 0
        ):
            _fail("SpargeParams", "pv_threshold", f"must be a negative number or None, got {self.pv_threshold!r}")


@dataclass(frozen=True)
class BFLAParams(_Params):
    """BFLA (Wu et al. 2026): flatten-g pooled block mass selection, then tile-level rescue.

    Defaults are the paper's highlighted operating point (Table 5): b=256, g=64, γ=0.99, n_local=8, ρ=0, η=16.
    ``mass_threshold=1.0`` keeps every causal block.
    ``score_scale`` is α of Eq. 9; ``None`` uses the attention's scale (1/√C), as the paper writes. A flatten-g
    score sums g token products, so with α = 1/√C the block softmax is nearly one-hot on real models and γ has
    little effect; α = 1/(g·√C) puts block logits on the scale of token logits.
    """

    coarse_block_size: int = 256
    group_size: int = 64
    mass_threshold: float = 0.99
    tile_size_q: int = 128
    tile_size_kv: int = 64
    local_tiles: int = 8
    sink_tiles: int = 1
    stride: int = 16
    random_rescue: float = 0.0
    seed: int = 0
    score_scale: float | None = None

    def __post_init__(self) -> None:
        _check_block("BFLAParams", "coarse_block_size", self.coarse_block_size)
        _check_int("BFLAParams", "group_size", self.group_size, low=1)
        if self.coarse_block_size % self.group_size:
            _fail("BFLAParams", "group_size", f"must divide coarse_block_size={self.coarse_block_size}")
        _check_fraction("BFLAParams", "mass_threshold", self.mass_threshold)
        _check_block("BFLAParams", "tile_size_q", self.tile_size_q)
        _check_block("BFLAParams", "tile_size_kv", self.tile_size_kv)
        for name in ("tile_size_q", "tile_size_kv"):
            if self.coarse_block_size % getattr(self, name):
                _fail("BFLAParams", name, f"must divide coarse_block_size={self.coarse_block_size}")
        _check_int("BFLAParams", "local_tiles", self.local_tiles)
        _check_int("BFLAParams", "sink_tiles", self.sink_tiles)
        _check_int("BFLAParams", "stride", self.stride)
        _check_fraction("BFLAParams", "random_rescue", self.random_rescue)
        _check_int("BFLAParams", "seed", self.seed)
        if self.score_scale is not None and (
            not isinstance(self.score_scale, (int, float)) or isinstance(self.score_scale, bool)
            or not self.score_scale > 0
        ):
            _fail("BFLAParams", "score_scale", f"must be a positive number or None, got {self.score_scale!r}")


@dataclass(frozen=True)
class S2OParams(_Params):
    """S2O (Zhang et al. 2026): query sort inside segments, per-segment prefix-key ranking, early stop.

    Defaults from the paper (Sec. 4.1): S=2048, τ=0.005, tiles (128, 128).
    ``early_stop=0.0`` never stops: every causal key is visited.
    """

    segment_size: int = 2048
    early_stop: float = 0.005
    block_size_q: int = 128
    block_size_kv: int = 128
    sort_queries: bool = True

    def __post_init__(self) -> None:
        _check_block("S2OParams", "block_size_q", self.block_size_q)
        _check_block("S2OParams", "block_size_kv", self.block_size_kv)
        _check_int("S2OParams", "segment_size", self.segment_size, low=1)
        for name in ("block_size_q", "block_size_kv"):
            if self.segment_size % getattr(self, name):
                _fail("S2OParams", "segment_size", f"must be a multiple of {name}={getattr(self, name)}")
        _check_fraction("S2OParams", "early_stop", self.early_stop)


@dataclass(frozen=True)
class XAttentionParams(_Params):
    """XAttention antidiagonal block scoring (Xu et al. 2025), the selector PBS combines with its permutation.

    Defaults: threshold 0.9, stride 8 (as the PBS paper ran it). ``threshold=1.0`` keeps every causal block.
    """

    block_size: int = 128
    stride: int = 8
    threshold: float = 0.9
    keep_first_block: bool = True

    def __post_init__(self) -> None:
        _check_block("XAttentionParams", "block_size", self.block_size)
        _check_int("XAttentionParams", "stride", self.stride, low=1)
        if self.block_size % self.stride:
            _fail("XAttentionParams", "stride", f"must divide block_size={self.block_size}")
        _check_fraction("XAttentionParams", "threshold", self.threshold)


METHOD_NAMES = ("pbs", "sparge", "bfla", "s2o")
KERNEL_NAMES = ("auto", "triton", "reference")
PLANNER_NAMES = ("auto", "fast", "reference")

_PARAM_FIELDS = {"pbs": "pbs", "sparge": "sparge", "bfla": "bfla", "s2o": "s2o", "xattention": "xattention"}


@dataclass(frozen=True)
class SparseConfig:
    """Everything the ``sparse_prefill`` backend and ``sparse_attention`` need.

    method          one of ``METHOD_NAMES``: a preset of a reorder stage and a select stage.
    reorder/select  override the preset's stages (for example ``method="pbs", select="xattention"``).
    min_seq_len     shorter query lengths run exact dense attention (no speedup regression on short prompts).
    skip_layers     attention sites left dense: an int is a layer index (the first integer in the module path,
                    e.g. ``model.layers.3.self_attn`` is layer 3), a str is a substring of the module path.
    kernel          "triton" (GPU), "reference" (PyTorch, any device) or "auto" (Triton on CUDA, else reference).
    planner         the reorder/select stages that build the plan: "fast" (Triton kernels, CUDA or the interpreter),
                    "reference" (PyTorch) or "auto" (fast on CUDA when Triton is there, else reference).
    record_density  measure each call's achieved density (costs a host sync; off by default).
    pbs/sparge/bfla/s2o/xattention  parameters of each stage, their papers' defaults.
    """

    method: str = "pbs"
    reorder: str | None = None
    select: str | None = None
    enabled: bool = True
    min_seq_len: int = 16384
    skip_layers: tuple[int | str, ...] = ()
    kernel: str = "auto"
    planner: str = "auto"
    record_density: bool = False
    pbs: PBSParams = field(default_factory=PBSParams)
    sparge: SpargeParams = field(default_factory=SpargeParams)
    bfla: BFLAParams = field(default_factory=BFLAParams)
    s2o: S2OParams = field(default_factory=S2OParams)
    xattention: XAttentionParams = field(default_factory=XAttentionParams)

    def __post_init__(self) -> None:
        if self.method not in METHOD_NAMES:
            raise ValueError(f"SparseConfig.method: unknown method {self.method!r}; valid: {list(METHOD_NAMES)}")
        # stage names and pairs come from the methods registry (imported lazily: it imports this module)
        from . import methods as _methods

        check_pair = getattr(_methods, "check_stage_pair", None)
        if check_pair is not None:
            try:
                check_pair(self.reorder_stage, self.select_stage)
            except ValueError as exc:
                raise ValueError(f"SparseConfig: {exc}") from None
        if not isinstance(self.enabled, bool):
            raise ValueError(f"SparseConfig.enabled: must be a bool, got {self.enabled!r}")
        _check_int("SparseConfig", "min_seq_len", self.min_seq_len, low=2)
        if isinstance(self.skip_layers, (str, int)) or not all(
            isinstance(x, (int, str)) and not isinstance(x, bool) for x in self.skip_layers
        ):
            raise ValueError(
                f"SparseConfig.skip_layers: must be a sequence of layer indices (int) or module-path substrings "
                f"(str), got {self.skip_layers!r}"
            )
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if self.kernel not in KERNEL_NAMES:
            raise ValueError(f"SparseConfig.kernel: unknown kernel {self.kernel!r}; valid: {list(KERNEL_NAMES)}")
        if self.planner not in PLANNER_NAMES:
            raise ValueError(f"SparseConfig.planner: unknown planner {self.planner!r}; valid: {list(PLANNER_NAMES)}")
        for name, cls in (("pbs", PBSParams), ("sparge", SpargeParams), ("bfla", BFLAParams),
                          ("s2o", S2OParams), ("xattention", XAttentionParams)):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, cls().updated(value))
            elif not isinstance(value, cls):
                raise ValueError(f"SparseConfig.{name}: must be a {cls.__name__} or a dict of its fields")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "SparseConfig":
        """Build from ``torch.compile(..., options={...})``: keys are this dataclass's fields."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"sparse_prefill options: unknown key(s) {unknown}; valid keys: {list(cls.field_names())}")
        return cls(**options)

    # -- stages ---------------------------------------------------------------------------------------------
    @property
    def reorder_stage(self) -> str:
        if self.reorder is not None:
            return self.reorder
        return {"pbs": "pbs", "sparge": "none", "bfla": "none", "s2o": "s2o"}[self.method]

    @property
    def select_stage(self) -> str:
        return self.select if self.select is not None else self.method

    def with_overrides(self, method: str | None = None, params: Mapping[str, Any] | None = None) -> "SparseConfig":
        """A copy with another method and/or parameters of the selected method (or of SparseConfig itself).

        ``params`` keys may be SparseConfig fields (``min_seq_len=...``) or fields of the active method's
        parameter dataclass (``threshold=0.8`` for pbs). A key that is neither is an error naming the valid ones.
        """
        config = self if method is None else dataclasses.replace(self, method=method, reorder=None, select=None)
        if not params:
            return config
        top: dict[str, Any] = {}
        stage: dict[str, Any] = {}
        stage_name = _PARAM_FIELDS.get(config.select_stage, config.method)
        stage_params = getattr(config, stage_name)
        for key, value in params.items():
            if key in self.field_names():
                top[key] = value
            elif key in stage_params.field_names():
                stage[key] = value
            else:
                raise ValueError(
                    f"unknown parameter {key!r} for method {config.method!r}; valid: "
                    f"{sorted(set(self.field_names()) | set(stage_params.field_names()))}"
                )
        if stage:
            top[stage_name] = stage_params.updated(stage)
        return dataclasses.replace(config, **top)

    def keep_all(self) -> "SparseConfig":
        """The same method with the parameters that keep every causal block: exact dense attention."""
        return dataclasses.replace(
            self,
            pbs=dataclasses.replace(self.pbs, threshold=1.0),
            sparge=dataclasses.replace(self.sparge, cdf_threshold=1.0, pv_threshold=None),
            bfla=dataclasses.replace(self.bfla, mass_threshold=1.0),
            s2o=dataclasses.replace(self.s2o, early_stop=0.0),
            xattention=dataclasses.replace(self.xattention, threshold=1.0),
        )
