"""Why a density is as high as it is: the line the examples print beside it (a helper of the examples, not one).

A plan's density is the share of the causal attention tiles it computes. Two things keep it high on the small CPU
runs of the examples, and neither is a fault: every plan of the strided-row selectors (``sampled``, ``peak``)
keeps some tiles whatever the scores say (the sink tile, ``local_tiles`` tiles before each diagonal, the last
query block exactly), which on a short prompt is most of them; and random weights attend almost uniformly, so a
method that drops only tiles below a mass or score threshold (PBS, BFLA, SpargeAttn, S2O) finds few to drop.
"""

from __future__ import annotations

import textwrap
from typing import Optional

import sparse_compile


def kept_by_every_plan(config: sparse_compile.SparseConfig, num_tokens: int) -> Optional[float]:
    """The share of the causal tiles that every plan of ``config``'s select stage keeps on a ``num_tokens``-token
    prefill, whatever the scores (None where the method has no such tiles)."""
    params = config.params_of(config.select_stage)
    needed = ("block_size", "local_tiles", "keep_first_block", "exact_tail_blocks")
    if not all(hasattr(params, name) for name in needed):
        return None
    blocks = -(-num_tokens // params.block_size)
    total = kept = 0
    for block in range(blocks):
        causal = block + 1  # the tiles this query block sees, its diagonal included
        total += causal
        if block >= blocks - params.exact_tail_blocks:
            kept += causal  # computed exactly
        else:  # its diagonal, the local tiles before it and the sink tile
            kept += min(causal, params.local_tiles + 1 + int(params.keep_first_block))
    return kept / total


def explain_density(config: sparse_compile.SparseConfig, num_tokens: int, density: Optional[float]) -> str:
    """One line saying why ``density`` (measured at ``num_tokens`` under ``config``) is what it is, or ""."""
    method = config.select_stage
    floor = kept_by_every_plan(config, num_tokens)
    if floor is not None:
        params = config.params_of(method)
        longer = kept_by_every_plan(config, 4 * num_tokens)
        rows = params.block_size * params.exact_tail_blocks
        return _wrapped(f"at {num_tokens} tokens every {method} plan keeps {floor:.2f} of the tiles whatever the "
                        f"scores: the sink, {params.local_tiles} before each diagonal, the last {rows} rows exactly "
                        f"(at {4 * num_tokens}: {longer:.2f}; --seq-len)")
    if density is not None and density >= 0.99:
        return _wrapped("random weights attend almost uniformly: few tiles fall below a mass or score threshold, so "
                        "such a method computes (nearly) all of them here; trained weights concentrate attention (the "
                        "README's method table)")
    return ""


def _wrapped(text: str) -> str:
    return textwrap.fill(f"({text})", width=118, subsequent_indent=" ")
