"""The path one call's queries take through the package, from the op's entry to the kernel and back.

Every call into a function of the package or its kernels that holds the entry's ``q`` (the same tensor) is traced
(``sys.setprofile``); the files ``q`` is in, one after another, give the walk. A file visited again after ``q``
left it is a layer the call bounces through, and each return into another file one more hop: the structure a
reader follows from ``causal_attention`` to the launch. Predicates that need only a device, a dtype or shapes
take those, not the tensors.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

import sparse_compile
from sparse_compile.attention_op import causal_attention
from sparse_compile.site import SiteSpec

ROOTS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sparse_compile, sparse_compile.kernels))
MOST_VISITS, MOST_RETURNS = 3, 10


def _walk(q, run) -> list[tuple[str, str]]:
    """(file, how q arrived: "call" or "return") for each change of file along the walk."""
    stack, walk = [], []

    def profile(frame, event, _arg):
        if event not in ("call", "return") or not frame.f_code.co_filename.startswith(ROOTS):
            return
        if not any(value is q for value in frame.f_locals.values()):
            return
        if event == "call":
            stack.append(frame.f_code.co_filename)
            here = stack[-1]
        else:
            stack.pop()
            here = stack[-1] if stack else None
        if here is not None and (not walk or walk[-1][0] != here):
            walk.append((here, event))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return walk


CASES = [  # (method, kernel, planner): the CPU's path, and the default's GPU path (fast planner, Triton kernel)
    # interpreted; peak and bfla walk the GPU path as sampled does (10 and 9 returns; 20 s more under the interpreter)
    ("sampled", "reference", "reference"), ("pbs", "reference", "reference"), ("peak", "reference", "reference"),
    ("sampled", "triton", "fast"),
]


@pytest.mark.parametrize("method,kernel,planner", CASES)
def test_a_sparse_call_visits_each_file_at_most_three_times_and_returns_at_most_ten_times(method, kernel, planner):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 320, 16), torch.randn(1, 1, 320, 16), torch.randn(1, 1, 320, 16)
    config = sparse_compile.SparseConfig(method=method, min_seq_len=64, dense_when_faster=False, kernel=kernel,
                                         planner=planner)
    spec = SiteSpec(site="walked", config=config, enable_gqa=True).to_json()
    sparse_compile.reset_runtime_stats()
    causal_attention(q, k, v, None, spec)  # first calls fill caches: the walk is of a call a server repeats
    walk = _walk(q, lambda: causal_attention(q, k, v, None, spec))
    assert sparse_compile.runtime_stats()["walked"].calls.get(("sparse", f"method {method} ({kernel})")) == 2
    visits = collections.Counter(path for path, _ in walk)
    returns = sum(1 for _, how in walk if how == "return")
    shown = " -> ".join(os.path.relpath(path, os.path.dirname(ROOTS[0].rstrip(os.sep))) for path, _ in walk)
    assert max(visits.values()) <= MOST_VISITS, shown
    assert returns <= MOST_RETURNS, shown
