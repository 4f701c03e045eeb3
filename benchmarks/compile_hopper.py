"""Compile the Gluon Hopper kernel for sm_90a on a machine without a GPU, and report registers and spills.

The device run is scarce; a kernel that does not compile, or that spills in its walk, should be caught before it.
Needs a Triton whose Gluon API is the kernel's (3.6, the GPU's: unpack its wheel and put it first on PYTHONPATH):

    PYTHONPATH=/tmp/tri36 python benchmarks/compile_hopper.py [--only walk,window] [--ptxas]

Each case prints: compiled or the error, shared memory, whether the PTX has wgmma / TMA, and with ``--ptxas`` the
registers and spill bytes ptxas reports (Triton's bundled ptxas, ``-v``), and whether ptxas serialised the wgmmas
(its C7514 note: each MMA then waits for the previous one, and the kernel loses its overlap).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

# name -> the kernel's constexprs that differ from the plain dense kernel (D=128, 128x128 tiles, 3 stages)
CASES = {
    "dense": {},
    "walk": dict(HAS_KIDX=True, HAS_QIDX=True, EARLY_STOP=True, GATHER=True, SKIP_MASKED=True, RESUME=True),
    "static_walk": dict(HAS_KIDX=True, HAS_QIDX=True, GATHER=True, SKIP_MASKED=True, RESUME=True),
    "walk_copied": dict(HAS_KIDX=True, HAS_QIDX=True, EARLY_STOP=True, SKIP_MASKED=True, RESUME=True),
    "one_pass": dict(HAS_KIDX=True, HAS_QIDX=True, EARLY_STOP=True),
    "window": dict(WRITE_LSE=True),
    "window_free": dict(WRITE_LSE=True, PINGPONG=0),
    "window_persistent": dict(WRITE_LSE=True, PERSISTENT=True),
    "window_persistent_timeline": dict(WRITE_LSE=True, PERSISTENT=True, TIMELINE=True),
    "window_persistent_free": dict(WRITE_LSE=True, PERSISTENT=True, PINGPONG=0),
    "dense_persistent": dict(PERSISTENT=True),
    "persistent_free_kidx": dict(PERSISTENT=True, PINGPONG=0, HAS_KIDX=True, PV_SKIP=True),
    "window_timeline": dict(WRITE_LSE=True, TIMELINE=True),
    "walk_timeline": dict(HAS_KIDX=True, HAS_QIDX=True, EARLY_STOP=True, GATHER=True, SKIP_MASKED=True, RESUME=True,
                          TIMELINE=True),
    "stop_pvskip": dict(EARLY_STOP=True, PV_SKIP=True),
    "stop_2stages": dict(EARLY_STOP=True, STAGES=2),
    "stop_d64": dict(EARLY_STOP=True, HEAD_DIM=64, HAS_KIDX=True, GATHER=True),
}


#: pointer arguments of the attention kernels (Triton's ``_block_sparse_attn_fwd`` and the Gluon one), by element
#: type; their scalar arguments are fp32 for the scales and int32 otherwise
POINTERS = {"Q": "bf16", "Out": "bf16", "K": "bf16", "V": "bf16", "TileOffsets": "i32", "TileCounts": "i32",
            "MaskedCounts": "i32", "KeyIndex": "i32", "QueryIndex": "i32", "Visited": "i32", "Lse": "fp32",
            "Timeline": "i64", "BlockRows": "i32"}
FP32_ARGS = ("qk_scale", "es_tau", "pv_lambda")


def kernel_signature(fn, const: dict, descriptors: dict) -> dict:
    """The argument types ``triton.compile`` needs for an attention kernel ``fn``: ``const``'s names are
    constexprs; ``descriptors`` maps tensor-descriptor arguments to their type strings (None: the case takes
    none, passed as a None constexpr and added to ``const``)."""
    sig = {}
    for arg in fn.arg_names:
        if arg in const:
            sig[arg] = "constexpr"
        elif arg in descriptors:
            sig[arg] = descriptors[arg] or "constexpr"
            if descriptors[arg] is None:
                const[arg] = None
        elif arg in POINTERS:
            sig[arg] = "*" + POINTERS[arg]
        else:
            sig[arg] = "fp32" if arg in FP32_ARGS else "i32"
    return sig


def compile_case(name: str, extra: dict, ptxas: bool, keep: str = "") -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from kernels import hopper

    const = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, STAGES=3, NUM_WARPS=4, CONSUMER_REGS=hopper.CONSUMER_REGS, HAS_KIDX=False, PV_SKIP=False, HAS_QIDX=False,
                 EARLY_STOP=False, GATHER=False, LOAD_WARPS=hopper.GATHER_LOAD_WARPS,
                 GATHER_ROWS=hopper.GATHER_ROWS_PER_COPY, INT32_OFFSETS=True,
                 LOAD_REGS=hopper.GATHER_LOAD_REGS, SKIP_MASKED=False, RESUME=False, WRITE_LSE=False,
                 TIMELINE=False, PERSISTENT=False)
    const.update(extra)
    if "PINGPONG" not in extra:  # the wrapper's rule: staggered start without early stop
        const["PINGPONG"] = hopper.issue_order(1.0 if const["EARLY_STOP"] else 0.0)
    D, bn = const["HEAD_DIM"], const["BLOCK_N"]
    x = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, D], gl.bfloat16)
        return mangle_type(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, D], layout))

    fn = hopper._hopper_fwd_kernel
    sig = kernel_signature(fn, const, {"desc_q": desc(128), "desc_o": desc(64), "desc_k": desc(bn),
                                       "desc_v": desc(bn)})
    # what the JIT specialises at run time: 16-byte aligned pointers, and the K/V row strides (heads x D) are
    # multiples of 16 elements (the gathers' 16-byte cp.async needs to know it)
    aligned = set(POINTERS) | {"stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn",
                               "stride_qb", "stride_qh", "stride_qn", "stride_ob", "stride_oh", "stride_on"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names) if arg in aligned}
    try:
        k = triton.compile(GluonASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4, maxnreg=168))
    except Exception as exc:  # report and go on: one broken case should not hide the others
        return f"{name}: FAILED {type(exc).__name__}: {str(exc)[:2000]}"
    ptx = k.asm["ptx"]
    line = (f"{name}: ok shared={k.metadata.shared} wgmma={'wgmma.mma_async' in ptx} "
            f"tma={'cp.async.bulk.tensor' in ptx}")
    if ptxas:
        ptxas_bin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        with tempfile.TemporaryDirectory() as tmp:
            where = keep or tmp
            os.makedirs(where, exist_ok=True)
            src = os.path.join(where, f"{name}.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            out = subprocess.run([ptxas_bin, "-v", "--gpu-name", "sm_90a", "-maxrregcount", "168", src, "-o",
                                  os.path.join(where, f"{name}.cubin")], capture_output=True, text=True)
        regs = re.findall(r"Used (\d+) registers", out.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
        # C7514: ptxas serialised the wgmmas (a non-wgmma instruction touches an in-flight accumulator)
        line += f" regs={regs} spill_stores={spills} wgmma_serialized={'C7514' in out.stderr}"
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case names (default: all): " + ", ".join(CASES))
    ap.add_argument("--ptxas", action="store_true", help="also run ptxas -v for registers and spills")
    ap.add_argument("--gather-rows", type=int, default=0, help="override GATHER_ROWS_PER_COPY")
    ap.add_argument("--keep", default="", help="with --ptxas: write each case's PTX and cubin into this folder")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CASES)
    if args.gather_rows:
        from kernels import hopper

        hopper.GATHER_ROWS_PER_COPY = args.gather_rows
    failed = False
    for name in names:
        line = compile_case(name, CASES[name], args.ptxas, args.keep)
        failed |= "FAILED" in line
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
