"""``SiteSpec``: what the rewrite knows of one attention site, compiled into the graph as one string.

The op (``attention_op.py``) takes the site's tensors and this specification: the site's name, the compiled
configuration and the static facts of the call it replaced (how its causal mask was given, whether K/V are
shared by query heads, the output layout). It travels as JSON, so a graph stays printable and serialisable and
describes itself; the op reads it back once per distinct string.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields

from .config import SparseConfig
from .local import Local
from .state import STATE

__all__ = ["SiteSpec"]


@dataclass(frozen=True)
class SiteSpec:
    """One rewritten attention site.

    site            the module path ``runtime_stats()`` names it by.
    config          the configuration compiled in (``sparsity(...)`` regions apply on top, at run time).
    enable_gqa      SDPA's ``enable_gqa``: the replaced call's dense path.
    queries_last    the call's mask was proven causal, or is checked at run time: the queries are the last
                    positions of the keys (chunked prefill runs sparse). False: ``is_causal=True``, which SDPA
                    aligns top-left.
    binary_padding  the mask was proven for 0/1 key-padding values only: other values are an error.
    heads_inner     the replaced call's output memory layout (``attention_op.output_layout``).
    window, chunk   the mask was proven to be causal AND a sliding window / chunked local attention (``local.py``;
                    0: none).
    """

    site: str
    config: SparseConfig = field(default_factory=SparseConfig)
    enable_gqa: bool = False
    queries_last: bool = False
    binary_padding: bool = False
    heads_inner: bool = True
    window: int = 0
    chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.site, str):
            raise TypeError(f"SiteSpec.site: must be a str, got {type(self.site).__name__}")
        if not isinstance(self.config, SparseConfig):
            raise TypeError(f"SiteSpec.config: must be a SparseConfig, got {type(self.config).__name__}")
        for f in fields(self)[2:]:
            if f.name in ("window", "chunk"):
                continue
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"SiteSpec.{f.name}: must be True or False, got {getattr(self, f.name)!r}")
        Local(self.window, self.chunk)  # validates both

    @property
    def local(self) -> Local:
        """What the mask restricts beyond causal."""
        return Local(self.window, self.chunk)

    def to_json(self) -> str:
        """Compact: the site, the configuration's non-default fields and the flags that differ from the defaults."""
        flags = {f.name: getattr(self, f.name) for f in fields(self)[2:] if getattr(self, f.name) != f.default}
        return json.dumps({"site": self.site, "config": json.loads(self.config.to_json()), **flags}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "SiteSpec":
        """The specification ``to_json`` wrote (cached: read on every call of the op)."""
        return _from_json(text)

    def replace(self, **changes) -> "SiteSpec":
        return dataclasses.replace(self, **changes)


@STATE.cached("site.from_json", 4096)
def _from_json(text: str) -> SiteSpec:
    data = json.loads(text)
    config = SparseConfig.from_json(json.dumps(data.pop("config", {}), sort_keys=True))
    return SiteSpec(config=config, **data)
