"""sparse_compile: a torch.compile backend that runs causal prefill attention through sparse Triton kernels.

    model = torch.compile(model, backend="sparse_prefill", options={"method": "pbs"})
    with sparse_compile.sparsity(method="bfla"):
        logits = model(input_ids)
    print(sparse_compile.explain(model, input_ids))
"""

from .backend import sparse_prefill
from .config import BFLAParams, PBSParams, S2OParams, SparseConfig, SpargeParams, XAttentionParams
from .context import sparsity
from .explain import ExplainReport, explain
from .ops import sparse_attention
from .report import reset_runtime_stats, runtime_stats

__all__ = [
    "SparseConfig",
    "PBSParams",
    "SpargeParams",
    "BFLAParams",
    "S2OParams",
    "XAttentionParams",
    "sparse_prefill",
    "sparsity",
    "explain",
    "ExplainReport",
    "sparse_attention",
    "runtime_stats",
    "reset_runtime_stats",
]

__version__ = "0.1.0"
