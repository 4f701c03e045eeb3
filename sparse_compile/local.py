"""``Local``: attention restricted to nearby keys, on top of causal: a sliding window, chunked local attention.

Positions are those of the causal problem the pipeline runs: key ``j`` and query ``i`` counted from the first key
the problem holds (a padded row's first valid key), queries at the last positions of the keys. Key ``j`` is visible
to query ``i`` iff ``j <= i`` and

* ``window`` W > 0: ``i - j < W`` (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W``), and
* ``chunk`` C > 0: ``j // C == i // C`` (``chunked_overlay``, its ``left_padding`` offset being where the row's
  first valid key sits).

``Local()`` (both 0) is plain causal attention. The same value reaches the plans, the kernels' masked tiles and the
dense fallback, so that every path computes one mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Local", "CAUSAL"]


@dataclass(frozen=True)
class Local:
    window: int = 0  # keys closer than this to the query (0: no window)
    chunk: int = 0  # keys in the query's chunk of this many positions (0: no chunks)

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Local.{name}: must be an int >= 0 (0: none), got {value!r}")

    @property
    def is_causal(self) -> bool:
        """Nothing beyond causal."""
        return self.window == 0 and self.chunk == 0

    def binds(self, num_keys: int) -> bool:
        """Whether some causal pair of a problem with ``num_keys`` keys is outside (else it is plain causal)."""
        return (0 < self.window < num_keys) or (0 < self.chunk < num_keys)

    def visible(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """Bool ``(..., Nq, Nk)``: which keys each query sees, causal included (positions as in the module
        docstring; broadcasts like ``query_positions[..., :, None]`` against ``key_positions[..., None, :]``)."""
        i, j = query_positions[..., :, None], key_positions[..., None, :]
        seen = j <= i
        if self.window:
            seen = seen & (i - j < self.window)
        if self.chunk:
            seen = seen & (torch.div(j, self.chunk, rounding_mode="floor")
                           == torch.div(i, self.chunk, rounding_mode="floor"))
        return seen

    def describe(self) -> str:
        parts = [f"sliding window {self.window}" if self.window else "",
                 f"chunks of {self.chunk}" if self.chunk else ""]
        return " AND ".join(p for p in parts if p) or "causal"


CAUSAL = Local()
