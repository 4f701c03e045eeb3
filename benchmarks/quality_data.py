"""Data of the quality benchmarks: held-out documents of the small LM, and the attention inputs of a forward pass.

Used by ``quality.py`` (the CLI and report) through ``quality_eval.py``, and by ``attention_map.py``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm_corpus  # noqa: E402

__all__ = ["ckpt_manifest", "load_documents", "sdpa_replaced", "capture_attention_inputs"]


def ckpt_manifest(path: Path) -> dict:
    """The data manifest recorded next to the checkpoint (``<name>.json``)."""
    return json.loads(path.with_suffix(".json").read_text())["manifest"]


def load_documents(manifest: dict, lengths: list[int], counts: list[int], verify: bool) -> dict[int, dict]:
    """For each prompt length L: ``count`` distinct held-out files of >= L bytes, their first L bytes."""
    docs, used = {}, set()
    for length, count in sorted(zip(lengths, counts), reverse=True):  # the scarce long files first
        entries = lm_corpus.heldout_documents(manifest, length, count, exclude=used, verify=verify)
        used.update(e["path"] for e in entries)
        tokens = torch.stack([torch.frombuffer(bytearray(e["data"][:length]), dtype=torch.uint8) for e in entries])
        docs[length] = {"paths": [e["path"] for e in entries], "tokens": tokens.long()}
    return docs


@contextlib.contextmanager
def sdpa_replaced(wrapper):
    """``F.scaled_dot_product_attention`` replaced by ``wrapper(real_sdpa, q, k, v, attn_mask=..., dropout_p=...,
    is_causal=..., scale=..., enable_gqa=...)`` for the duration of the block."""
    real = F.scaled_dot_product_attention

    def replacement(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return wrapper(real, q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                       enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = replacement
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def capture_attention_inputs(store: list):
    """Record (q, k, v, scale) of every SDPA call of an eager forward (the attention inputs after RoPE)."""

    def capture(real, q, k, v, **kwargs):
        store.append({"q": q.detach(), "k": k.detach(), "v": v.detach(), "scale": kwargs["scale"],
                      "causal": kwargs["is_causal"], "mask": kwargs["attn_mask"] is not None})
        return real(q, k, v, **kwargs)

    return sdpa_replaced(capture)
