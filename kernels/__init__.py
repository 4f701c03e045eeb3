"""Triton kernels of sparse_compile (installed as ``sparse_compile.kernels``): the bottom layer.

They take plain tensors and numbers and import nothing from the package; ``sparse_compile.plan.execute_plan``
adapts a ``BlockPlan`` to ``block_sparse_attention``, and each method's fast stage calls its selection kernels.

Modules (``validate`` and ``reference`` import no Triton; the others are imported on first use, so
``import sparse_compile`` does not load Triton):

* ``validate``: the q/k/v validator, the supported dtypes, ``cdiv``, ``expand_heads``;
* ``reference``: the 32-bit hash and the segmented argsort in PyTorch, shared with the package's references;
* ``attention``: the block-sparse FlashAttention forward (``block_sparse_attention``, ``KernelConfig``);
* ``common``: Triton helpers and launch arithmetic shared by the selection kernels;
* ``pooling``: block pooling (``block_pool`` -> ``BlockPool``) and pooled scores;
* ``mass``: the cumulative-mass selection (``MassRule``, ``mass_select``) into plan rows;
* ``sorting``: the segmented argsort in registers;
* ``permute``: the permuted K/V copy (keys in a key index's order) that both attention kernels read;
* ``fp8``: e4m3 operands for score-only matmuls (``quantize_heads``, ``quantize_rows``) where the GPU has FP8;
* one module per method with selection kernels of its own (``kernels/<name>.py``, called by the fast stages of
  ``sparse_compile/methods/<name>.py``).
"""

import importlib

__all__ = ["block_sparse_attention", "KernelConfig", "default_config"]

_LAZY = {"block_sparse_attention": ".attention", "KernelConfig": ".attention", "default_config": ".attention"}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        for exported, where in _LAZY.items():
            if where == _LAZY[name]:
                globals()[exported] = getattr(module, exported)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
