"""Triton kernels of sparse_compile (installed as ``sparse_compile.kernels``): the bottom layer.

They take plain tensors and numbers and import nothing from the package. ``validate`` (shared checks) imports no
Triton; the kernels are imported on first use, so ``import sparse_compile`` does not load Triton.
"""

import importlib

__all__ = ["block_sparse_attention", "KernelConfig", "default_config"]

_LAZY = {"block_sparse_attention": ".block_sparse_attention", "KernelConfig": ".block_sparse_attention",
         "default_config": ".block_sparse_attention"}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        for exported, where in _LAZY.items():  # the functions, not the submodule bound under the same name
            if where == _LAZY[name]:
                globals()[exported] = getattr(module, exported)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
