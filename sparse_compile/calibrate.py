"""``calibrate``: per attention site, the sparsest setting of a method's density knob that keeps the operator error on
the user's own sample under a target.

SpargeAttn tunes its thresholds per layer on calibration data, XAttention ships per-layer tables: layers differ,
and one global threshold is either too sparse for some or too dense for others. Here:

1. The model runs once on the sample, traced and rewritten by the ``sparse_prefill`` rewrite (no Inductor) with
   sparsity off; every causal attention problem the op decides on is captured with its site
   (``pipeline.capturing``).
2. Per site, the knob the registry names (``Method.density``: name, range, which end keeps more) is bisected for
   the sparsest value whose error ``metric(sparse, dense)`` over all of the site's calls is at most the target.
   The sparse output is what the op would compute (``pipeline.run_method``: the method's plan and executor; the
   reference kernel on the CPU, Triton on CUDA). A site that misses the target even at the knob's keep-most end
   is left dense (``skip_layers``): exact, and never slower.
3. The result is a ``SparseConfig`` whose ``site_params`` hold each site's knob; the op applies a site's entry at
   run time, so it works compiled in (``options=calibration.config``) or applied to a model compiled before
   (``with calibration.sparsity(): ...``), without recompiling.

One knob per site: the selectors take one setting per call, so per-head settings are not searched.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import warnings

import torch
from torch import Tensor

from .config import SparseConfig
from .context import sparsity
from .dense import dense_causal_attention
from .padding import per_forward
from .pipeline import capturing, dense_reason, run_method
from .registry import DensityKnob, method_spec, registered_methods
from .rules import excluded, prefill_length

__all__ = ["calibrate", "Calibration", "SiteCalibration", "METRICS", "operator_error"]

FORMAT = "sparse_compile.calibration"
VERSION = 1


def _relative_l1(difference: Tensor, reference: Tensor) -> tuple[float, float]:
    return float(difference.abs().sum(dtype=torch.float64)), float(reference.abs().sum(dtype=torch.float64))


def _relative_l2(difference: Tensor, reference: Tensor) -> tuple[float, float]:
    return (float(difference.square().sum(dtype=torch.float64)), float(reference.square().sum(dtype=torch.float64)))


#: metric name -> (numerator, denominator) of one call; a site's error sums both over its calls
METRICS: dict[str, Callable[[Tensor, Tensor], tuple[float, float]]] = {
    "relative_l1": _relative_l1,  # sum |sparse - dense| / sum |dense|
    "relative_l2": _relative_l2,  # ||sparse - dense||_2 / ||dense||_2 (the ratio of sums, then the square root)
}


def operator_error(outputs, references, metric: str = "relative_l1") -> float:
    """The error of attention ``outputs`` against ``references`` (tensors, or lists of them summed over):
    ``relative_l1`` is ``sum |out - ref| / sum |ref|``, ``relative_l2`` the same with squares, then the root.
    Non-finite outputs give ``inf``."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {list(METRICS)}")
    if isinstance(outputs, Tensor):
        outputs, references = [outputs], [references]
    numerator = denominator = 0.0
    for out, ref in zip(outputs, references, strict=True):
        if not torch.isfinite(out).all():
            return math.inf
        part, whole = METRICS[metric](out.float() - ref.float(), ref.float())
        numerator, denominator = numerator + part, denominator + whole
    ratio = numerator / max(denominator, 1e-300)
    return math.sqrt(ratio) if metric == "relative_l2" else ratio


@dataclass(frozen=True)
class SiteCalibration:
    """What calibration found at one site.

    value    the knob's value (``knob`` of the method), or None where the site runs dense.
    density  fraction of causal tiles computed at that value (visited tiles under early stop), mean over heads
             and calls; 1.0 where dense.
    error    the metric at that value over the site's calls; 0.0 where dense (``note`` gives the error the knob's
             keep-most end had).
    calls    attention calls of the sample at this site (a padded batch gives one per group of rows).
    note     why the site runs dense, else "".
    """

    site: str
    value: Optional[float]
    density: float
    error: float
    calls: int
    note: str = ""

    def __post_init__(self) -> None:
        def number(name, value, low=-math.inf, high=math.inf, what="a finite number"):
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or not low <= value <= high):
                raise ValueError(f"SiteCalibration.{name} (site {self.site!r}): must be {what}, got {value!r}")

        if not isinstance(self.site, str) or not self.site:
            raise ValueError(f"SiteCalibration.site: must be a module path, got {self.site!r}")
        if self.value is not None:
            number("value", self.value)
        number("density", self.density, 0.0, what="a finite number >= 0")  # tiles visited / causal tiles: may pass 1
        number("error", self.error, 0.0, what="a finite number >= 0")
        if not isinstance(self.calls, int) or isinstance(self.calls, bool) or self.calls < 1:
            raise ValueError(f"SiteCalibration.calls (site {self.site!r}): must be an integer >= 1, got "
                             f"{self.calls!r}")
        if not isinstance(self.note, str):
            raise ValueError(f"SiteCalibration.note (site {self.site!r}): must be a str, got {self.note!r}")

    @property
    def dense(self) -> bool:
        return self.value is None


@dataclass(frozen=True)
class Calibration:
    """A calibrated configuration and how it was found.

    config        a ``SparseConfig``: the method, each calibrated site's knob in ``site_params``, sites that
                  missed the target in ``skip_layers``. Accepted by ``torch.compile(..., backend="sparse_prefill",
                  options=calibration.config)`` and ``SparseConfig.from_options``.
    target_error  the target each site's error was kept under, in ``metric``.
    sites         per-site results (``SiteCalibration``), in the order the model ran them.

    ``sparsity()`` applies it at run time to a model compiled with any configuration; ``save``/``load`` keep it as
    JSON.
    """

    config: SparseConfig
    target_error: float
    metric: str
    sites: tuple[SiteCalibration, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.config, SparseConfig):
            raise ValueError(f"Calibration.config: must be a SparseConfig, got {type(self.config).__name__}")
        _check_target(self.target_error, "Calibration.target_error")
        if not isinstance(self.metric, str) or self.metric not in METRICS:
            raise ValueError(f"Calibration.metric: unknown metric {self.metric!r}; valid: {list(METRICS)}")
        if isinstance(self.sites, (str, bytes, Mapping)) or not isinstance(self.sites, Iterable):
            raise ValueError(f"Calibration.sites: must be a list of SiteCalibration entries, got {self.sites!r}")
        object.__setattr__(self, "sites", tuple(self.sites))
        per_site = dict(self.config.site_params)
        knob = method_spec(self.config.select_stage).density
        seen = set()
        for entry in self.sites:
            if not isinstance(entry, SiteCalibration):
                raise ValueError(f"Calibration.sites: must hold SiteCalibration entries, got {entry!r}")
            if entry.site in seen:
                raise ValueError(f"Calibration.sites: site {entry.site!r} appears twice")
            seen.add(entry.site)
            skipped = excluded(entry.site, self.config.skip_layers)
            if entry.value is None:
                # a dense site that skip_layers does not name would run sparse at the method's defaults
                if skipped is None:
                    raise ValueError(f"Calibration: site {entry.site!r} is marked dense but config.skip_layers "
                                     f"{list(self.config.skip_layers)} does not skip it")
                continue
            if not knob.low <= entry.value <= knob.high:
                raise ValueError(f"Calibration: site {entry.site!r}: {self.knob}={entry.value} is outside the "
                                 f"knob's range [{knob.low}, {knob.high}]")
            if dict(per_site.get(entry.site, ())).get(self.knob) != entry.value:
                raise ValueError(f"Calibration: site {entry.site!r} was calibrated to {self.knob}={entry.value} "
                                 f"but config.site_params has {dict(per_site.get(entry.site, ()))}")
            if skipped is not None:  # its calibrated value would never be used
                raise ValueError(f"Calibration: site {entry.site!r} was calibrated to {self.knob}={entry.value} "
                                 f"but config.skip_layers skips it ({skipped})")

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def knob(self) -> str:
        """The parameter calibrated per site: the density knob of the configuration's select stage."""
        return method_spec(self.config.select_stage).density.name

    @property
    def density(self) -> float:
        """Mean density over the calibrated sites (dense sites count 1.0)."""
        return sum(s.density for s in self.sites) / max(len(self.sites), 1)

    def sparsity(self) -> sparsity:
        """A ``sparsity`` region that applies this calibration to a model compiled with any configuration, at
        run time and without recompiling: its method and that method's parameters, ``site_params``,
        ``skip_layers`` and ``min_seq_len`` (so the sample's length runs sparse there too). Other fields
        (``kernel``, ``record_density``, ...) stay as compiled."""
        return sparsity(**self.sparsity_options())

    def sparsity_options(self) -> dict[str, Any]:
        """The keyword arguments of ``sparsity()``'s region (to combine with other region options)."""
        config = self.config
        params: dict[str, Any] = dataclasses.asdict(config.params_of(config.method))
        for name in ("reorder", "select"):
            if getattr(config, name) is not None:
                params[name] = getattr(config, name)
        return dict(method=config.method, skip_layers=config.skip_layers, min_seq_len=config.min_seq_len,
                    site_params={site: dict(overrides) for site, overrides in config.site_params}, **params)

    # -- JSON ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        config = self.config.to_dict()
        config["skip_layers"] = list(config["skip_layers"])
        return {"format": FORMAT, "version": VERSION, "target_error": self.target_error, "metric": self.metric,
                "config": config, "sites": [dataclasses.asdict(s) for s in self.sites]}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "calibration") -> "Calibration":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source}: not a sparse_compile calibration (expected a JSON object with "
                             f"\"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise ValueError(f"{source}: calibration format version {data.get('version')!r}; this sparse_compile "
                             f"reads version {VERSION}")
        missing = sorted({"target_error", "metric", "config", "sites"} - set(data))
        if missing:
            raise ValueError(f"{source}: missing key(s) {missing}")
        if not isinstance(data["config"], dict):
            raise ValueError(f"{source}: config must be a JSON object of SparseConfig fields, got {data['config']!r}")
        try:
            config = SparseConfig(**data["config"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: config: {exc}") from None
        if not isinstance(data["sites"], list):
            raise ValueError(f"{source}: sites must be a JSON list of site entries, got {data['sites']!r}")
        names = [f.name for f in dataclasses.fields(SiteCalibration)]
        try:
            sites = []
            for entry in data["sites"]:
                if not isinstance(entry, dict) or sorted(set(entry) - {"note"}) != sorted(set(names) - {"note"}):
                    raise ValueError(f"each site entry needs the keys {names}, got {entry!r}")
                sites.append(SiteCalibration(**entry))
            return cls(config, data["target_error"], data["metric"], tuple(sites))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def save(self, path: Union[str, Path]) -> None:
        """Write this calibration as JSON (``load`` reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Calibration":
        """Read a calibration ``save`` wrote; the configuration is validated as ``SparseConfig`` validates it."""
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))

    def __str__(self) -> str:
        head = (f"sparse_compile.calibrate: method {self.method}, {self.knob} per site, {self.metric} <= "
                f"{self.target_error:g}; mean density {self.density:.3f}; min_seq_len {self.config.min_seq_len}")
        width = max([len(s.site) for s in self.sites] + [4])
        rows = [f"{'site':<{width}}  {self.knob:>14}  density  error"]
        for s in self.sites:
            value = "dense" if s.value is None else f"{s.value:.4f}"
            rows.append(f"{s.site:<{width}}  {value:>14}  {s.density:7.3f}  {s.error:.2e}"
                        + (f"  ({s.note})" if s.note else ""))
        return "\n".join([head] + rows)


# -- the search ---------------------------------------------------------------------------------------------------
@dataclass
class _Call:
    q: Tensor
    k: Tensor
    v: Tensor
    scale: Optional[float]
    device: torch.device  # where the model computed it (q, k, v may be offloaded)

    def inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(t.to(self.device) for t in (self.q, self.k, self.v))


def _check_target(target: Any, owner: str) -> None:
    if not isinstance(target, (int, float)) or isinstance(target, bool) or not (0.0 <= target < math.inf):
        raise ValueError(f"{owner}: must be a finite number >= 0, got {target!r}")


def _call_model(model: Callable, example_inputs: Any):
    if isinstance(example_inputs, Tensor):
        return model(example_inputs)
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    raise ValueError(f"calibrate: example_inputs must be a tensor (input ids), a dict of keyword arguments or a tuple "
                     f"of positional arguments, got {type(example_inputs).__name__}")


def _capture(model: Callable, example_inputs: Any, config: SparseConfig, offload: bool) -> dict[str, list[_Call]]:
    """site -> the causal attention problems the op met there on the sample (the dense model's inputs)."""

    # the rules a call must pass to be calibrated at all; sparsity on, any length (the sample is the user's)
    eligible = config.replace(enabled=True, min_seq_len=2)
    calls: dict[str, list[_Call]] = {}

    def record(site, q, k, v, scale, chunked_allowed):
        if dense_reason(q, k, v, eligible, site, chunked_allowed=chunked_allowed, scale=scale) is not None:
            return  # a decode step, a skipped layer, an unsupported head dim: the op never runs the method there
        device = q.device
        if offload:
            q, k, v = (t.to("cpu", copy=True) for t in (q, k, v))
        else:  # the graph may reuse its buffers after the op: keep copies
            q, k, v = (t.clone() for t in (q, k, v))
        calls.setdefault(site, []).append(_Call(q, k, v, scale, device))

    root = getattr(model, "_orig_mod", model)  # an already compiled module: trace the original
    traced = torch.compile(root, backend=_capture_backend)
    with torch.no_grad(), sparsity(enabled=False), capturing(record):
        _call_model(traced, example_inputs)
    return calls


def _capture_backend(gm, example_inputs):
    """Rewrite as the sparse_prefill backend does (so the sites have its names), without Inductor: the capture run
    only collects inputs. One function for every calibration: Dynamo then reuses the traced graph (it matches
    backends by identity) rather than compiling again, which would count against the model's recompile limit.
    The configuration compiled in does not matter: the run is dense, and ``record`` applies the rules."""
    from .rewrite import rewrite_graph

    rewrite_graph(gm, SparseConfig())
    return per_forward(gm.forward)


def _evaluate(inputs: list[tuple], references: list[Tensor], config: SparseConfig, metric: str):
    """(error, density) of ``config`` over a site's calls, or the reason the method cannot run them."""
    outputs, densities = [], []
    for q, k, v, scale in inputs:
        outcome = run_method(q, k, v, scale, config)
        if outcome.output is None:
            return outcome.reason
        outputs.append(outcome.output)
        densities.append(sum(outcome.density) / max(len(outcome.density), 1))
    return operator_error(outputs, references, metric), sum(densities) / len(densities)


def _search(site: str, calls: list[_Call], config: SparseConfig, knob: DensityKnob, target: float, metric: str,
            steps: int) -> SiteCalibration:
    inputs = [(*call.inputs(), call.scale) for call in calls]  # on the device once per site (offload)
    references = [dense_causal_attention(q, k, v, scale=scale) for q, k, v, scale in inputs]
    keep_most, sparsest = (knob.high, knob.low) if knob.higher_keeps_more else (knob.low, knob.high)

    def at(value: float):
        return _evaluate(inputs, references, config.with_overrides(None, {knob.name: value}), metric)

    found = at(keep_most)
    if isinstance(found, str):
        return SiteCalibration(site, None, 1.0, 0.0, len(calls), f"left dense: {found}")
    if found[0] > target:
        return SiteCalibration(site, None, 1.0, 0.0, len(calls), f"left dense: error {found[0]:.2e} > target even "
                                                                 f"at {knob.name}={keep_most:g}")
    good, good_result = keep_most, found
    sparse_result = at(sparsest)
    if not isinstance(sparse_result, str) and sparse_result[0] <= target:
        good, good_result = sparsest, sparse_result
    else:
        bad = sparsest
        for _ in range(steps):  # the error is about monotone in the knob: bisect; every kept value was measured
            middle = (good + bad) / 2
            result = at(middle)
            if not isinstance(result, str) and result[0] <= target:
                good, good_result = middle, result
            else:
                bad = middle
    return SiteCalibration(site, float(good), good_result[1], good_result[0], len(calls))


def calibrate(model: Callable, example_inputs: Any, *, method: Optional[str] = None, target_error: float,
              config: Optional[SparseConfig] = None, metric: str = "relative_l1", steps: int = 10,
              offload: bool = False, min_seq_len: Optional[int] = None) -> Calibration:
    """Per attention site, the sparsest value of ``method``'s density knob whose error on the sample stays at most
    ``target_error``; returns a ``Calibration`` (its ``config`` goes to the backend, its ``sparsity()`` to a model
    compiled before; ``save``/``load`` as JSON).

    model          the module (or callable) as it will be compiled, or an already compiled module: sites are named
                   by module path relative to it, as ``runtime_stats()`` names them, so compile the same module.
    example_inputs the user's sample: a tensor (``model(input_ids)``), a dict (``model(**kwargs)``) or a tuple
                   (``model(*args)``). Run once under ``torch.no_grad()``, attention dense.
    method         a registered method; its knob is ``Method.density`` (pbs ``threshold``, sparge
                   ``cdf_threshold``, bfla ``mass_threshold``, s2o ``early_stop``, the strided-row selectors'
                   ``budget``). Default: ``config``'s method, or ``SparseConfig()``'s (the default method).
    target_error   the most error allowed per site, in ``metric``: "relative_l1" (``sum |sparse - dense| /
                   sum |dense|`` of the attention output over the site's calls) or "relative_l2". 0 leaves every
                   site dense.
    config         the base configuration (block sizes, ``skip_layers``, ``min_seq_len``, ...); its other parameters
                   are kept, and sites it skips are not calibrated. Default: ``SparseConfig(method=method)``.
    steps          bisection steps per site (the knob's range / 2**steps is the resolution).
    offload        keep the captured q, k, v on the CPU between the capture and the search (long samples on a GPU:
                   otherwise every site's q, k, v stay on the device until the search ends).
    min_seq_len    the returned configuration's ``min_seq_len``. Unset (None, and ``config`` leaves it at the
                   default 16384 or is None): the sample's length (its shortest calibrated call, as the length rule
                   counts it) where that is shorter, so the calibrated prompts run sparse under ``config`` and
                   shorter ones stay dense. Set here or in ``config`` (any other value): kept, with a UserWarning
                   naming ``min_seq_len`` where it is above the sample's length (the sample would run dense).

    Sites whose error exceeds the target even at the knob's keep-most end (or where the method declines the
    input) are left dense, through ``skip_layers``. One knob per site (per layer): per-head settings are not
    searched. Every site is searched on the inputs of the dense model, so each bounds its own operator error;
    errors of earlier sites still move the inputs of later ones when all run sparse. The sample's length need not
    reach ``min_seq_len`` (the search runs every call of the sample); ``min_seq_len`` above says what is returned.
    """
    if config is not None and not isinstance(config, SparseConfig):
        raise ValueError(f"calibrate(config=...): must be a SparseConfig, got {type(config).__name__}")
    if method is None:
        method = (config or SparseConfig()).method
    methods = registered_methods()
    if method not in methods:
        raise ValueError(f"calibrate: unknown method {method!r}; valid: {list(methods)}")
    _check_target(target_error, "calibrate(target_error=...)")
    if metric not in METRICS:
        raise ValueError(f"calibrate: unknown metric {metric!r}; valid: {list(METRICS)}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"calibrate(steps=...): must be an integer >= 1, got {steps!r}")
    base = SparseConfig(method=method) if config is None else config
    if base.method != method:
        base = base.with_overrides(method)
    if min_seq_len is not None:
        try:
            base.replace(min_seq_len=min_seq_len)
        except ValueError as exc:
            raise ValueError(f"calibrate(min_seq_len=...): {exc}") from None
    base = base.replace(site_params=(), record_density=True)  # the search measures density per call
    knob = method_spec(base.select_stage).density

    captured = _capture(model, example_inputs, base, offload)
    if not captured:
        raise ValueError("calibrate: the sample ran no attention call the sparse_prefill backend would make sparse "
                         "(no causal self-attention site was rewritten, or every call was a decode step or skipped); "
                         "sparse_compile.explain(model, ...) says why per site")
    sample_length = min(prefill_length(call.q.shape[-2], call.k.shape[-2]) for calls in captured.values()
                        for call in calls)
    results = []
    with torch.no_grad():
        for site, calls in captured.items():
            results.append(_search(site, calls, base, knob, float(target_error), metric, steps))
            captured[site] = []  # free this site's inputs before the next
    site_params = {r.site: {knob.name: r.value} for r in results if not r.dense}
    # a dense site is skipped by its whole path (skip_layers entries match whole path components)
    skip = tuple(base.skip_layers) + tuple(r.site for r in results
                                           if r.dense and excluded(r.site, base.skip_layers) is None)
    final = SparseConfig(method=method) if config is None else config
    if final.method != method:
        final = final.with_overrides(method)
    length = _returned_min_seq_len(min_seq_len, config, sample_length)
    final = final.replace(site_params=site_params, skip_layers=skip, min_seq_len=length)
    return Calibration(final, float(target_error), metric, tuple(results))


#: ``SparseConfig``'s default ``min_seq_len``: a config holding it is taken to leave the length unset
_DEFAULT_MIN_SEQ_LEN = next(f.default for f in dataclasses.fields(SparseConfig) if f.name == "min_seq_len")


def _returned_min_seq_len(given: Optional[int], config: Optional[SparseConfig], sample_length: int) -> int:
    """The calibrated configuration's ``min_seq_len``: the caller's (``calibrate(min_seq_len=...)``, else a
    ``config`` value other than the default), warned about where the sample would run dense under it; otherwise
    the default lowered to the sample's length, so that the calibrated sample runs sparse."""
    if given is None and config is not None and config.min_seq_len != _DEFAULT_MIN_SEQ_LEN:
        given, source = config.min_seq_len, "config.min_seq_len"
    else:
        source = "calibrate(min_seq_len=...)"
    if given is None:
        return min(_DEFAULT_MIN_SEQ_LEN, max(sample_length, 2))
    if given > sample_length:
        warnings.warn(f"calibrate: min_seq_len={given} ({source}) is above the sample's length {sample_length}: "
                      f"compiled with calibration.config the sample's prompts run dense (q_len {sample_length} < "
                      f"min_seq_len {given}); pass calibrate(..., min_seq_len={sample_length}) or leave min_seq_len "
                      "unset (it then becomes the sample's length)", UserWarning, stacklevel=3)
    return given
