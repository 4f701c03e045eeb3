"""Triton kernels of sparse_compile (installed as ``sparse_compile.kernels``)."""

from .block_sparse_attention import KernelConfig, block_sparse_attention, default_config

__all__ = ["block_sparse_attention", "KernelConfig", "default_config"]
