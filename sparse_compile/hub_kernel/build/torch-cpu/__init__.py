"""The kernel module the ``kernels`` package loads for ``sparse-compile/flash-sparse-prefill`` (``LOCAL_KERNELS``):
FlashAttention's entry points from the installed ``sparse_compile`` (``sparse_compile/serving.py``)."""

from sparse_compile.serving import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
