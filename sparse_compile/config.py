"""Configuration: one validated dataclass for the backend and the parameters of every registered method.

``SparseConfig`` holds the backend's own fields and one parameters object per registered method (``registry.py``;
their base class and field checks are ``params.py``), each under the method's name: ``SparseConfig(method="bfla",
bfla={"mass_threshold": 0.95})``. Every registered method's parameters, built in or added, are read with
``config.params_of(BFLAParams)`` (typed by the class) or ``config.params_of("bfla")``. This module names no method:
what it knows of them comes from the registry.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Optional, TypeVar, Union, overload

from .params import MAX_INT, MethodParams, check_int
from .registry import NO_REORDER, check_stage_pair, method_spec, registered_methods, reserve_names
from .state import STATE

__all__ = ["SparseConfig", "DEFAULT_METHOD", "KERNEL_NAMES", "PLANNER_NAMES", "normalize_site_params",
           "check_skip_layers"]

KERNEL_NAMES = ("auto", "triton", "reference")
PLANNER_NAMES = ("auto", "fast", "reference")


def check_skip_layers(skip_layers: Any, owner: str = "SparseConfig.skip_layers") -> tuple:
    """``skip_layers`` as a tuple, or ValueError: layer indices (int >= 0) and module paths (str) naming whole
    components (``"layers.1"`` matches ``model.layers.1.self_attn``, not ``model.layers.10.self_attn``)."""
    if isinstance(skip_layers, (str, int)) or not isinstance(skip_layers, Iterable) or not all(
        isinstance(x, (int, str)) and not isinstance(x, bool) for x in skip_layers
    ):
        raise ValueError(f"{owner}: must be a sequence of layer indices (int) or module paths (str), got "
                         f"{skip_layers!r}")
    for item in skip_layers:
        if isinstance(item, int) and not 0 <= item <= MAX_INT:
            raise ValueError(f"{owner}: layer indices must be >= 0 and <= {MAX_INT}, got {item!r} (a site's layer "
                             "index is the first integer in its module path)")
        if isinstance(item, str) and (not item.strip(".") or ".." in item or item != item.strip()):
            raise ValueError(f"{owner}: a module path must name whole components of a site's path (e.g. "
                             f"'layers.1' or 'model.layers.1.self_attn'), got {item!r}")
    return tuple(skip_layers)


P = TypeVar("P", bound=MethodParams)


def _method_params(name: str, value: Any, spelling: Optional[str] = None) -> MethodParams:
    cls = method_spec(name).params
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls().updated(value)
    raise ValueError(f"SparseConfig.{spelling or name}: must be a {cls.__name__} or a dict of its fields, got "
                     f"{type(value).__name__}")


def _params_argument(value: Any, registered: Mapping[str, Any]) -> dict:
    """``SparseConfig(params=...)`` as ``{method: its parameters}``: a mapping ``{method: params or dict}``, or the
    ``(method, params)`` pairs that ``config.params`` holds. Anything else is a ValueError saying what it takes."""
    if value is None:
        return {}
    shape = ("must be a dict {method name: its parameters (a dict of them or its params dataclass)}, e.g. "
             "params={'<method>': {'<parameter>': value}}, or the (name, params) pairs that config.params holds")
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"SparseConfig.params: {shape}; got {type(value).__name__} {value!r}")
    else:
        items = list(value)
        if not all(isinstance(item, (tuple, list)) and len(item) == 2 for item in items):
            raise ValueError(f"SparseConfig.params: {shape}; got {value!r}")
    out: dict = {}
    for name, params in items:
        if not isinstance(name, str) or name not in registered:
            owners = [m for m, spec in registered.items() if name in spec.params.field_names()]
            hint = (f" ({name!r} is a parameter of method(s) {owners}, not a method: give it by its own name, "
                    f"{name}=..., or in its method's section, {owners[0]}={{{name!r}: ...}})" if owners else "")
            raise ValueError(f"SparseConfig.params: unknown method {name!r}; valid: {list(registered)}{hint}")
        if name in out:
            raise ValueError(f"SparseConfig.params: method {name!r} appears twice")
        _fields_given(name, params, f"params[{name!r}]")  # its kind, checked before anything is merged
        out[name] = params
    return out


def _fields_given(name: str, value: Any, spelling: str) -> tuple:
    """The fields that ``value`` (a method's section: its params dataclass or a dict) sets: a dataclass sets all."""
    cls = method_spec(name).params
    if isinstance(value, cls):
        return cls.field_names()
    if isinstance(value, Mapping):
        return tuple(value)
    raise ValueError(f"SparseConfig.{spelling}: must be a {cls.__name__} or a dict of its fields, got "
                     f"{type(value).__name__}")


def _spelled(spelling: str, value: Any, field: str) -> str:
    """How the user wrote one field of a section: ``pbs['threshold']=0.5`` or ``pbs=PBSParams(...)``."""
    if isinstance(value, Mapping):
        return f"{spelling}[{field!r}]={value[field]!r}"
    return f"{spelling}={type(value).__name__}({field}={getattr(value, field)!r}, ...)"  # a dataclass sets all


def _twice(method: str, field: str, first: str, second: str) -> ValueError:
    return ValueError(f"SparseConfig: parameter {field!r} of method {method!r} is given twice, as {first} and as "
                      f"{second}; give it once (the last would silently win)")


def _merge_sections(name: str, sources: list) -> Any:
    """One method's section from several spellings ``[(spelling, value), ...]`` (``params[...]``, its keyword):
    their fields merged; a field set by two of them is a ValueError naming both."""
    if len(sources) == 1:
        return sources[0][1]
    (first, a), (second, b) = sources
    both = sorted(set(_fields_given(name, a, first)) & set(_fields_given(name, b, second)), key=str)
    if both:
        raise _twice(name, both[0], _spelled(first, a, both[0]), _spelled(second, b, both[0]))
    if not isinstance(a, Mapping):  # a dataclass sets every field: the other is an empty dict
        return a
    if not isinstance(b, Mapping):
        return b
    return {**a, **b}


def _kernel_options(value: Any) -> tuple:
    """``SparseConfig.kernel_options`` as sorted (name, value) pairs (hashable), or the error naming the problem."""
    from .kernels.validate import check_kernel_options

    if value is None:
        return ()
    if isinstance(value, tuple):  # pairs, as the field holds them
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise ValueError(f"SparseConfig.kernel_options: must be a dict of launch parameters, got {value!r}") \
                from None
    check_kernel_options(value, "SparseConfig.kernel_options")
    return tuple(sorted(value.items()))


def normalize_site_params(value: Any, owner: str = "SparseConfig.site_params") -> tuple:
    """``{site: {param: value}}`` (or this function's own output) as a sorted, hashable tuple of
    ``(site, ((param, value), ...))`` pairs. Checks the shape only; the parameters are checked against the method
    by ``SparseConfig``."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(site, overrides) for site, overrides in items]
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: must be a dict {{module path: {{parameter: value}}}}, got {value!r}") from None
    out = []
    for site, overrides in pairs:
        if not isinstance(site, str) or not site:
            raise ValueError(f"{owner}: keys must be attention sites' module paths (non-empty str, as "
                             f"runtime_stats() names them), got {site!r}")
        if isinstance(overrides, Mapping):
            overrides = overrides.items()
        try:
            overrides = tuple(sorted((str(k), v) for k, v in overrides))
        except (TypeError, ValueError):
            raise ValueError(f"{owner}[{site!r}]: must be a dict of the method's parameters, got "
                             f"{overrides!r}") from None
        for key, item in overrides:
            if not (item is None or isinstance(item, (bool, int, float, str))):
                raise ValueError(f"{owner}[{site!r}].{key}: must be a number, bool, str or None, got {item!r}")
        if overrides:  # an empty entry changes nothing
            out.append((site, overrides))
    if len({site for site, _ in out}) != len(out):
        raise ValueError(f"{owner}: a site appears twice in {value!r}")
    return tuple(sorted(out))


#: what a user gets with no options: the selector that keeps >= 95% of dense retrieval on formats the retrieval model
#: never trained on, at 16K-64K (docs/results.md "Retrieval"); PBS, faster, keeps 0.2-0.6 of it at density 0.1
DEFAULT_METHOD = "sampled"


@dataclass(frozen=True, init=False)
class SparseConfig:
    """Everything the ``sparse_prefill`` backend and ``sparse_attention`` need.

    method          a registered method (``registry.py``): a preset of a reorder stage and a select stage; default
                    ``DEFAULT_METHOD`` (``sampled``).
    reorder/select  override the preset's stages (``method="pbs", reorder="none"``: PBS's selector without its
                    permutation; the valid pairs come from the registry).
    enabled         False runs exact dense attention everywhere.
    min_seq_len     shorter query lengths run exact dense attention (no speedup regression on short prompts).
    skip_layers     attention sites left dense: an int is a layer index (the first integer in the module path,
                    e.g. ``model.layers.3.self_attn`` is layer 3), a str names whole components of the module path
                    (``"layers.1"`` skips ``model.layers.1.self_attn``, not ``model.layers.10.self_attn``).
    kernel          which kernel runs the plans: "auto" (on CUDA the Gluon Hopper kernel where it serves the call, the
                    Triton kernel otherwise; elsewhere the reference), "triton" (the Triton kernel only: CUDA, or
                    the CPU under ``TRITON_INTERPRET=1``) or "reference" (PyTorch, any device). The environment
                    variable ``SPARSE_COMPILE_ATTENTION_BACKEND=triton`` makes "auto" skip the Hopper kernel too.
    kernel_options  the Triton kernel's launch parameters over its own choice per tile size and head dim, as
                    FlexAttention's ``kernel_options``: ``{"num_warps": 8, "num_stages": 2}`` (names and values:
                    ``kernels.validate.KERNEL_OPTIONS``). Giving any runs the Triton kernel (they tune it).
    planner         the reorder/select stages that build the plan: "fast" (Triton kernels, CUDA or the interpreter),
                    "reference" (PyTorch) or "auto" (fast on CUDA when Triton is there, else reference).
    record_density  measure each call's achieved density (costs a host sync; off by default).
    dense_when_faster  on GPUs with a measured break-even table, run dense attention where this site's last plan
                    was too dense for the sparse path to win (``breakeven.py``); False always runs the method.
    site_params     per-site parameters of the method (its select stage), applied at run time on top of the method's
                    own: ``{"model.layers.3.self_attn": {"threshold": 0.93}}``. Keys are module paths exactly as
                    ``runtime_stats()`` names the sites (relative to the compiled module); ``sparse_attention``'s site
                    is ``"sparse_attention"``. ``calibrate`` writes them. They belong to the method: a region that
                    switches the method (``sparsity(method=...)``) leaves them behind.
    <method name>   that method's parameters (a dict of its fields or its params dataclass), e.g. ``pbs={...}``;
                    read back as ``config.params_of(PBSParams)`` or ``config.params_of("pbs")``. ``params`` holds
                    them all, as (name, params) pairs, and takes them so, or as a dict ``{name: params}``
                    (``SparseConfig(params=other.params)``); a method in both ``params`` and its own keyword gets
                    the fields of both.
    <parameter>     a parameter of the configured method (its select stage) by its own name, as ``sparsity`` and
                    ``options`` take it: ``SparseConfig(threshold=0.5)`` is ``SparseConfig(pbs={"threshold": 0.5})``.
                    A parameter given by two of these spellings (``{"sampled": {"budget": 0.5}, "budget": 0.3}``)
                    is a ValueError naming both: no spelling silently wins. Size-like parameters are bounded where
                    they are given (``params.MAX_SPAN`` tokens for segments and coarse blocks, ``params.MAX_TILES``
                    for counts of tiles, BFLA's ``MAX_GROUPS`` groups per coarse block).
    """

    method: str = DEFAULT_METHOD
    reorder: Optional[str] = None
    select: Optional[str] = None
    enabled: bool = True
    min_seq_len: int = 16384
    skip_layers: tuple = ()
    kernel: str = "auto"
    kernel_options: tuple = ()
    planner: str = "auto"
    record_density: bool = False
    dense_when_faster: bool = True
    site_params: tuple = ()
    params: tuple = ()

    def __init__(self, method: str = DEFAULT_METHOD, reorder: Optional[str] = None, select: Optional[str] = None,
                 enabled: bool = True, min_seq_len: int = 16384, skip_layers=(), kernel: str = "auto",
                 kernel_options=None, planner: str = "auto", record_density: bool = False,
                 dense_when_faster: bool = True, site_params=None, params=None,
                 **method_params: Union[MethodParams, Mapping[str, Any]]) -> None:
        # every registered method's name is a keyword (its parameters), and so is each parameter of the configured one
        registered = registered_methods()
        knobs = {k: v for k, v in method_params.items() if k not in registered}
        method_params = {k: v for k, v in method_params.items() if k in registered}
        # each method's section may come as params[name] and as the keyword name=...: merged field by field, and
        # one parameter given by two spellings (or by a section and a flat key below) is an error, not "last wins"
        from_params = _params_argument(params, registered)
        given, spelling = {}, {}
        for name in registered:
            sources = [(f"params[{name!r}]", from_params[name])] if name in from_params else []
            if name in method_params:
                sources.append((name, method_params[name]))
            if sources:
                given[name] = _merge_sections(name, sources)
                spelling[name] = sources[-1][0]  # where a wrong kind of value is named: the keyword, if given
        if knobs:  # the configured method's parameters by their own names, as sparsity(...) takes them
            stage = select if select is not None else method
            if not isinstance(method, str) or method not in registered:
                raise ValueError(f"SparseConfig.method: unknown method {method!r}; valid: {list(registered)}")
            if not isinstance(stage, str) or stage not in registered:
                raise ValueError(f"SparseConfig: unknown field(s) {sorted(knobs)}; valid: "
                                 f"{list(self.field_names())}")
            names = registered[stage].params.field_names()
            unknown = sorted(set(knobs) - set(names))
            if unknown:
                raise ValueError(f"SparseConfig: unknown field(s) {unknown}; valid: {list(self.field_names())} and "
                                 f"the parameters of method {stage!r}: {list(names)}")
            if stage in given:
                section = given[stage]
                both = sorted(set(_fields_given(stage, section, spelling[stage])) & set(knobs))
                if both:
                    raise _twice(stage, both[0], _spelled(spelling[stage], section, both[0]) + " (the method's "
                                 "section)", f"{both[0]}={knobs[both[0]]!r} (a flat key: the configured method's "
                                 "parameter by its own name)")
            # merged before the parameters are built: fields valid only together (a group and its coarse block)
            # may come one in the section, one by its own name (a dataclass section sets every field: no knobs)
            given[stage] = {**given.get(stage, {}), **knobs}
            spelling.setdefault(stage, stage)
        resolved = {name: _method_params(name, given[name], spelling[name]) if name in given else spec.params()
                    for name, spec in registered.items()}
        if not isinstance(method, str) or method not in registered:
            raise ValueError(f"SparseConfig.method: unknown method {method!r}; valid: {list(registered)}")
        for name, value in (("method", method), ("reorder", reorder), ("select", select), ("enabled", enabled),
                            ("min_seq_len", min_seq_len), ("kernel", kernel), ("planner", planner),
                            ("record_density", record_density), ("dense_when_faster", dense_when_faster),
                            ("params", tuple(resolved.items()))):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "skip_layers", check_skip_layers(skip_layers))
        for reserved in (reorder, select):
            if reserved is not None and not isinstance(reserved, str):
                raise ValueError(f"SparseConfig.reorder/select: must be a stage name or None, got {reserved!r}")
        try:
            check_stage_pair(self.reorder_stage, self.select_stage)
        except ValueError as exc:
            raise ValueError(f"SparseConfig: {exc}") from None
        for name in ("enabled", "record_density", "dense_when_faster"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SparseConfig.{name}: must be True or False, got {getattr(self, name)!r}")
        check_int("SparseConfig", "min_seq_len", self.min_seq_len, low=2, high=2**63 - 1)  # compared, never launched
        if self.kernel not in KERNEL_NAMES:
            raise ValueError(f"SparseConfig.kernel: unknown kernel {self.kernel!r}; valid: {list(KERNEL_NAMES)}")
        if self.planner not in PLANNER_NAMES:
            raise ValueError(f"SparseConfig.planner: unknown planner {self.planner!r}; valid: {list(PLANNER_NAMES)}")
        object.__setattr__(self, "site_params", normalize_site_params(site_params))
        object.__setattr__(self, "kernel_options", _kernel_options(kernel_options))
        stage = self.select_stage
        for site, overrides in self.site_params:
            try:
                self.params_of(stage).updated(dict(overrides))
            except ValueError as exc:
                raise ValueError(f"SparseConfig.site_params[{site!r}] (parameters of method {stage!r}): "
                                 f"{exc}") from None

    def __repr__(self) -> str:
        """Only what differs from ``SparseConfig()``, as keyword arguments that rebuild it (a method's section
        shows its changed fields): ``SparseConfig(method='pbs', pbs={'threshold': 1.0})``."""
        default = SparseConfig().to_dict()
        parts = []
        for key, value in self.to_dict().items():
            if isinstance(value, dict) and key in registered_methods():
                value = {name: item for name, item in value.items() if item != default.get(key, {}).get(name)}
                if value:
                    parts.append(f"{key}={value!r}")
            elif value != default.get(key):
                parts.append(f"{key}={value!r}")
        return f"SparseConfig({', '.join(parts)})"

    def __hash__(self) -> int:
        # hashed on every call of the op (the resolved configuration and the density history are keyed by it):
        # computed once per process (string hashes differ between processes, and a pickled config may travel)
        cached = self.__dict__.get("_hash")
        if cached is None or cached[0] != os.getpid():
            cached = (os.getpid(), hash(tuple(getattr(self, f.name) for f in fields(self))))
            object.__setattr__(self, "_hash", cached)
        return cached[1]

    @overload
    def params_of(self, method: type[P]) -> P: ...

    @overload
    def params_of(self, method: str) -> MethodParams: ...

    def params_of(self, method):
        """The parameters of ``method``: a registered method's name, or its parameter class (then typed as it:
        ``config.params_of(SampledParams).budget``)."""
        if isinstance(method, str):
            name = method_spec(method).name
        else:
            names = [spec.name for spec in registered_methods().values() if spec.params is method]
            if len(names) != 1:
                raise ValueError(f"SparseConfig.params_of: {getattr(method, '__name__', method)!r} is the parameter "
                                 f"class of {len(names)} registered methods ({names}); pass the method's name")
            name = names[0]
        for registered, value in self.params:
            if registered == name:
                return value
        raise ValueError(f"SparseConfig.params_of: method {name!r} was registered after this configuration was made; "
                         "make it again (or use sparsity(method=...))")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The keyword names: the backend's own fields and one per registered method."""
        return tuple(f.name for f in fields(cls) if f.name != "params") + tuple(registered_methods())

    @classmethod
    def from_options(cls, options: Any) -> "SparseConfig":
        """Build from ``torch.compile(..., options=...)``: a mapping of this dataclass's fields and of the configured
        method's parameters (``{"threshold": 0.5}``, as ``sparsity`` takes them), or a SparseConfig."""
        if isinstance(options, SparseConfig):
            return options
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"sparse_prefill options: expected a dict of SparseConfig fields or a SparseConfig, got "
                             f"{type(options).__name__}")
        options = dict(options or {})
        odd = [key for key in options if not isinstance(key, str)]
        if odd:
            raise ValueError(f"sparse_prefill options: keys must be names (str), got {odd!r}")
        valid = list(cls.field_names())
        stage = options.get("select") or options.get("method", DEFAULT_METHOD)
        if isinstance(stage, str) and stage in registered_methods():  # its parameters by their own names
            valid += [name for name in method_spec(stage).params.field_names() if name not in valid]
        unknown = sorted(set(options) - set(valid) - {"params"})
        if unknown:
            raise ValueError(f"sparse_prefill options: unknown key(s) {unknown}; valid keys: {valid}")
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this configuration (methods' parameters and ``site_params`` as dicts)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "params"}
        out["site_params"] = {site: dict(overrides) for site, overrides in self.site_params}
        out["kernel_options"] = dict(self.kernel_options)
        out.update({name: dataclasses.asdict(value) for name, value in self.params})
        return out

    def to_json(self) -> str:
        """Compact JSON: only the fields that differ from the defaults (``{}`` is the default configuration). The
        compiled graph carries its configuration so: the graph describes itself."""
        return json.dumps(_non_default(self.to_dict(), SparseConfig().to_dict()), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "SparseConfig":
        """The configuration ``to_json`` wrote (cached: read on every call of the op)."""
        return _from_json(text)

    def replace(self, **changes: Any) -> "SparseConfig":
        """A copy with some fields (or some methods' whole parameters, or parameters of the configured method by
        their own names: ``replace(threshold=0.5)``) changed."""
        base = self.to_dict()
        registered = registered_methods()
        method, select = changes.get("method", self.method), changes.get("select", self.select)
        stage = select if select is not None else method
        if isinstance(stage, str) and stage in registered and stage not in changes:
            # a parameter by its own name changes the configured method's section (which to_dict spells out)
            names = registered[stage].params.field_names()
            knobs = {k: changes.pop(k) for k in list(changes) if k in names and k not in base}
            if knobs and stage in base:
                base[stage] = {**base[stage], **knobs}
            else:
                changes.update(knobs)
        return SparseConfig(**{**base, **changes})

    # -- stages ---------------------------------------------------------------------------------------------
    @property
    def reorder_stage(self) -> str:
        if self.reorder is not None:
            return self.reorder
        return self.method if method_spec(self.method).reorder is not None else NO_REORDER

    @property
    def select_stage(self) -> str:
        return self.select if self.select is not None else self.method

    def with_overrides(self, method: Optional[str] = None,
                       params: Optional[Mapping[str, Any]] = None) -> "SparseConfig":
        """A copy with another method and/or parameters of the selected method (or of SparseConfig itself).

        ``params`` keys may be SparseConfig fields (``min_seq_len=...``) or fields of the selected method's
        parameter dataclass (``threshold=0.8`` for pbs). A key that is neither is an error naming the valid ones.
        """
        config = self if method is None else self._switched(method=method, reorder=None, select=None)
        if not params:
            return config
        own = {f.name for f in fields(self)} - {"params"}
        top: dict[str, Any] = {}
        stage: dict[str, Any] = {}
        stage_name = config.select_stage
        stage_params = config.params_of(stage_name)
        for key, value in params.items():
            if key in own:
                top[key] = value
            elif key in stage_params.field_names():
                stage[key] = value
            else:
                raise ValueError(
                    f"unknown parameter {key!r} for method {config.method!r}; valid: "
                    f"{sorted(own | set(stage_params.field_names()))}"
                )
        if stage:
            top[stage_name] = stage_params.updated(stage)
        return config._switched(**top)

    def _switched(self, **changes: Any) -> "SparseConfig":
        """``replace``, leaving ``site_params`` behind when the select stage changes (they are its parameters)."""
        if self.site_params and "site_params" not in changes:
            method = changes.get("method", self.method)
            select = changes.get("select", self.select)
            if (select if select is not None else method) != self.select_stage:
                changes["site_params"] = ()
        return self.replace(**changes)

    def for_site(self, site: str) -> "SparseConfig":
        """The configuration in force at ``site``: its ``site_params`` entry, if any, applied to the method's
        parameters. Cached: asked on every call of the op."""
        if not self.site_params:
            return self
        return _at_site(self, site)

    def keep_all(self) -> "SparseConfig":
        """The same configuration with every method's keep-everything setting: exact dense attention."""
        return self.replace(site_params=(), **{name: spec_params.updated(method_spec(name).keep_all)
                                               for name, spec_params in self.params})


reserve_names(f.name for f in fields(SparseConfig))  # no method may be called as a field

def _non_default(value: dict, default: dict) -> dict:
    out = {}
    for key, item in value.items():
        if key not in default:  # an entry of a free-form mapping (site_params): kept whole
            out[key] = item
        elif isinstance(item, dict):
            sub = _non_default(item, default[key])
            if sub:
                out[key] = sub
        elif item != default[key]:
            out[key] = list(item) if isinstance(item, tuple) else item
    return out


@STATE.cached("config.from_json", 64)
def _from_json(text: str) -> SparseConfig:
    return SparseConfig(**json.loads(text))


@STATE.cached("config.at_site", 4096)
def _at_site(config: SparseConfig, site: str) -> SparseConfig:
    overrides = dict(config.site_params).get(site)
    if overrides is None:
        return config
    stage = config.select_stage
    return config.replace(site_params=(), **{stage: config.params_of(stage).updated(dict(overrides))})
