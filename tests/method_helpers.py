"""The method tests' small configurations (``SMALL``, ``_config``) and structured inputs (strong sink keys)."""

import torch

from sparse_compile import SparseConfig
from sparse_compile.extend import BFLAParams, PBSParams, S2OParams, SampledParams, SpargeParams
from sparse_compile.methods.antidiag import AntidiagParams
from sparse_compile.methods.peak import PeakParams

# small blocks so that CPU tests have many blocks at N ~ 100-300
SMALL = dict(
    pbs=PBSParams(block_size=16, segment_size=32),
    sparge=SpargeParams(block_size_q=32, block_size_kv=16),
    bfla=BFLAParams(coarse_block_size=32, group_size=8, tile_size_q=16, tile_size_kv=16, local_tiles=1, stride=4),
    s2o=S2OParams(segment_size=64, block_size_q=16, block_size_kv=16),
    # tiny prompts: local tiles and the exact tail would cover most of them (tests of their own: test_tail_and_local.py)
    sampled=SampledParams(block_size=16, sample_every=4, budget=0.3, local_tiles=0, exact_tail_blocks=0),
    antidiag=AntidiagParams(block_size=16, score_stride=4, row_stride=2, budget=0.3, local_tiles=0,
                            exact_tail_blocks=0),
    peak=PeakParams(block_size=16, sample_every=4, budget=0.3, local_tiles=0, exact_tail_blocks=0),
)


def _config(reorder, select, **overrides):
    params = dict(SMALL)
    params.update(overrides)
    return SparseConfig(method="pbs", reorder=reorder, select=select, **params)


def _unit(shape, generator):
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def sink_inputs(batch, heads_q, heads_kv, n, dim=16, tile=16, seed=0):
    """Every query points at e0; the first ``tile`` keys are strong e0 sinks; other key tiles are self-similar."""
    g = torch.Generator().manual_seed(seed)
    e0 = torch.zeros(dim, dtype=torch.float64)
    e0[0] = 1.0
    dirs = _unit((batch, heads_kv, -(-n // tile), dim), g).repeat_interleave(tile, dim=2)[:, :, :n]
    k = dirs + 0.1 * torch.randn(batch, heads_kv, n, dim, generator=g, dtype=torch.float64)
    k[:, :, :tile] = 8 * e0 + 0.1 * torch.randn(batch, heads_kv, tile, dim, generator=g, dtype=torch.float64)
    q = 4 * e0 + 0.3 * torch.randn(batch, heads_q, n, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads_kv, n, dim, generator=g, dtype=torch.float64)
    return q, k, v
