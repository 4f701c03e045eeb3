"""A sixth method, defined outside the package in this one file: a sliding window of key blocks plus the sink.

Everything a method needs is here: its parameters, its select stage (a reference; no fast twin, so the fast
planner runs it too), the knob that sets its density and its keep-everything setting. Registering it is one line:
``sparse_compile.extend.register_method(WINDOW)``.
"""

from dataclasses import dataclass

import torch

from sparse_compile.extend import DensityKnob, Method, MethodParams
from sparse_compile.plan import VISIBLE_NONE, block_visibility, plan_from_block_mask


@dataclass(frozen=True)
class WindowParams(MethodParams):
    """Each query block keeps the first key block and the ``window_blocks`` key blocks ending at its diagonal.

    ``window_blocks=0`` keeps every causal block (exact dense attention).
    """

    block_size: int = 64
    window_blocks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"WindowParams.block_size: must be a power of two >= 16, got {self.block_size}")
        if self.window_blocks < 0:
            raise ValueError(f"WindowParams.window_blocks: must be >= 0, got {self.window_blocks}")


def select_window(q: torch.Tensor, k: torch.Tensor, scale: float, reordering, params: WindowParams):
    block = params.block_size
    batch, heads, num_queries, _ = q.shape
    num_keys = k.shape[2]
    visibility = block_visibility(num_queries, num_keys, block, block, batch=batch, heads=heads, device=q.device)
    visible = visibility != VISIBLE_NONE
    if params.window_blocks == 0:
        return plan_from_block_mask(visible, visibility, block, block)
    query_block = torch.arange(visibility.shape[-2], device=q.device)[:, None]
    key_block = torch.arange(visibility.shape[-1], device=q.device)[None, :]
    # the block holding each query block's last position, in key-block units
    diagonal = (num_keys - num_queries + torch.clamp((query_block + 1) * block, max=num_queries) - 1) // block
    keep = (key_block == 0) | (key_block > diagonal - params.window_blocks)
    return plan_from_block_mask(keep.expand_as(visible) & visible, visibility, block, block)


WINDOW = Method(
    name="window",
    params=WindowParams,
    select=select_window,
    density=DensityKnob("window_blocks", low=1, high=64),
    keep_all={"window_blocks": 0},
    description="sliding window of key blocks plus the first block",
)
