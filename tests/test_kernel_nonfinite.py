"""The Triton block-sparse attention core on non-finite keys and values: NaN reaches exactly the rows that attend it.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""

import pytest
import torch

from sparse_compile.plan import causal_plan, execute_plan

from helpers import DEV, _sink_qkv


# ------------------------------------------------------------------------------------- non-finite inputs


def _computed_tile(plan, visited, b, h, i, tile):
    """Whether query block (b, h, i) computed key tile ``tile`` (identity order): listed within its visited."""
    offs = plan.tile_offsets[b, h, i, : int(visited[b, h, i])].tolist()
    return tile * plan.block_n in offs


NONFINITE_OPTIONS = {"plain": {}, "pv-skip": {"pv_skip": -3.0}, "early-stop": {"early_stop": 0.05},
                     "both": {"early_stop": 0.05, "pv_skip": -3.0}}


# every option on the reference executor; on the Triton kernel (interpreted: ~10 s a case) none and both together
@pytest.mark.parametrize("executor, options", [
    pytest.param(executor, NONFINITE_OPTIONS[name], id=f"{name}-{executor}")
    for executor, names in (("reference", NONFINITE_OPTIONS), ("triton", ("plain", "both"))) for name in names])
@pytest.mark.parametrize("where", ["key", "value"])
def test_nonfinite_key_or_value_reaches_exactly_the_rows_that_attend_it(executor, where, options):
    """As dense attention: rows that attend a NaN key (or value) output NaN, rows that do not stay finite, and
    query blocks before it are unchanged. (Before: with the P.V skip the reference wrote zero rows for a NaN
    key.) An early stop may end a walk before the tile, so "attend" means: the block computed the tile and the
    row's position is at or after the key's. A NaN value also reaches the rows of its tile before it (P = 0
    times NaN, as in dense kernels), and a skipped P.V never reads it."""
    B, Hq, Hkv, N, D, b = 2, 4, 2, 96, 32, 16
    q, k, v = _sink_qkv(B, Hq, Hkv, N, N, D, torch.float32)
    batch, kv_head = int(torch.randint(B, ())), int(torch.randint(Hkv, ()))
    j = int(torch.randint(16, N, ()))  # not a sink key, so that early stop and P.V skip still trigger
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if where == "key" else bad_v)[batch, kv_head, j] = float("nan")
    plan = causal_plan(B, Hq, N, N, b, b, device=DEV).with_options(**options)
    clean = execute_plan(q, k, v, plan, kernel=executor)
    out, visited = execute_plan(q, bad_k, bad_v, plan, kernel=executor, return_visited=True)
    group = Hq // Hkv
    for h in range(Hq):
        for i in range(-(-N // b)):
            rows = torch.arange(i * b, min((i + 1) * b, N))
            block = out[batch, h, rows]
            if h // group != kv_head or not _computed_tile(plan, visited, batch, h, i, j // b):
                assert bool(torch.isfinite(block).all()), (h, i)
                continue
            sees = rows >= j
            if where == "key":
                assert bool(block[sees].isnan().all()), (h, i)
                assert bool(torch.isfinite(block[~sees]).all()), (h, i)  # masked scores never touch the NaN
            else:  # a P.V share dropped by the skip still multiplies V (0 * NaN, documented in plan.py)
                assert bool(block[sees].isnan().all()), (h, i)
    # query blocks before the key's block never read it: unchanged
    before = slice(0, j // b * b)
    torch.testing.assert_close(out[:, :, before], clean[:, :, before], rtol=0, atol=0)
