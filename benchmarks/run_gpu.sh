#!/usr/bin/env bash
# The maintained GPU measurements, one part per call (each under 10 minutes on one H100), from the repository root:
#
#   bash benchmarks/run_gpu.sh OUT tests      # the GPU tests (pytest -m gpu, four workers), ~2.5 min
#   bash benchmarks/run_gpu.sh OUT verify     # each method at its defaults against cuDNN (never slower), ~5 min
#   bash benchmarks/run_gpu.sh OUT table      # the break-even table (writes sparse_compile/breakeven_tables.json)
#                                             # and peak extra memory, ~7 min
#   bash benchmarks/run_gpu.sh OUT kernel     # the Hopper kernel: correctness, then timing against cuDNN, ~2 min
#   bash benchmarks/run_gpu.sh OUT e2e        # whole-model TTFT at defaults, 8K-64K, ~8 min
#   bash benchmarks/run_gpu.sh OUT e2e-long   # the same at 128K, plus density 0.1, ~8 min
#   bash benchmarks/run_gpu.sh OUT retrieval  # retrieval kept by each method, 16K-64K, ~3 min
#   bash benchmarks/run_gpu.sh OUT quality    # bits per byte and operator error on the trained small LM, ~2 min
#   bash benchmarks/run_gpu.sh OUT soak       # a server's day: 1,000 compiled calls, p99/p50, memory, ~8 min
#   bash benchmarks/run_gpu.sh OUT windows    # one sliding-window layer: band against FlexAttention and SDPA, ~3 min
#   bash benchmarks/run_gpu.sh OUT windows-model  # Gemma-3 / Mistral shapes, whole-model TTFT, ~8 min
#   bash benchmarks/run_gpu.sh OUT serving    # a prompt prefilled in 8K chunks over a cache against one call, ~3 min
#   bash benchmarks/run_gpu.sh OUT batching   # continuous batching (generate_batch) on the kernel route, ~5 min;
#                                             # needs the kernels package and transformers >= 5.22 on PYTHONPATH
#
# PART_S bounds one part's seconds (default 590).
#
# Each part writes its run's tables and log under OUT and appends its rows to OUT/<benchmark>.jsonl; append those
# to the repository's stores with `cat OUT/bench_e2e.jsonl >> benchmarks/results/bench_e2e.jsonl` (and so on).
set -uo pipefail
out=${1:?results folder}
part=${2:?part: tests, verify, table, kernel, e2e, e2e-long, retrieval, quality, soak, windows, windows-model, serving or batching}
limit=${PART_S:-590}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# kernels/ is imported as sparse_compile.kernels through the install's mapping: install this checkout (no network)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || cat "$out/install.log"
clock() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$out/gpu.txt"; }
clock
case "$part" in
tests)
    timeout $limit python -m pytest -q -n 4 -m gpu tests/ -p no:cacheprovider 2>&1 | tail -30 > "$out/gpu_tests.txt"
    tail -3 "$out/gpu_tests.txt" ;;
verify)
    # queued: the host runs ahead of the GPU as inside a forward pass
    timeout $limit python benchmarks/bench_breakeven.py --verify --calls 4 --reps 7 --queue-ahead --out "$out" 2>&1 \
        | tee "$out/verify_log.txt" | grep -v "^{" | tail -50 ;;
table)
    timeout $limit python benchmarks/bench_breakeven.py --measure --memory --reps 5 --out "$out" 2>&1 \
        | tee "$out/table_log.txt" | grep -v "^{" | tail -40
    cp sparse_compile/breakeven_tables.json "$out/" ;;
kernel)
    timeout $limit python benchmarks/check_hopper.py --out "$out/hopper.json" 2>&1 | tee "$out/kernel_log.txt" | tail -30 ;;
e2e)
    timeout $limit python benchmarks/bench_e2e.py --lengths 8192 16384 32768 65536 --budget-lengths --skip-eager \
        --reps 3 --out "$out" 2>&1 | tee "$out/e2e_log.txt" | grep -v "^{" | tail -40 ;;
e2e-long)
    timeout $limit python benchmarks/bench_e2e.py --lengths 131072 --budgets 0.1 --budget-lengths 131072 --skip-eager \
        --reps 2 --name e2e_long --out "$out" 2>&1 | tee "$out/e2e_long_log.txt" | grep -v "^{" | tail -40 ;;
retrieval)
    timeout $limit python benchmarks/bench_retrieval.py --out "$out" 2>&1 | tee "$out/retrieval_log.txt" \
        | grep -v "^{" | tail -40 ;;
quality)
    timeout $limit python benchmarks/quality.py --out-dir "$out" 2>&1 | tee "$out/quality_log.txt" | tail -40 ;;
soak)
    timeout $limit python benchmarks/bench_soak.py --layers 1 --max-minutes 7.3 --out "$out" 2>&1 \
        | tee "$out/soak_log.txt" | grep -v "^{" | tail -12 ;;
windows)
    timeout $limit python benchmarks/bench_windows.py --part layer --lengths 32768 131072 --reps 5 --store --out "$out" 2>&1 \
        | tee "$out/windows_log.txt" | grep -v "^{" | tail -30 ;;
windows-model)
    timeout $limit python benchmarks/bench_windows.py --part model --lengths 32768 65536 --reps 2 --store --out "$out" 2>&1 \
        | tee "$out/windows_model_log.txt" | grep -v "^{" | tail -30 ;;
serving)
    timeout $limit python benchmarks/bench_serving.py --lengths 65536 131072 --chunk 8192 --layers 8 --reps 3 \
        --store --out "$out" 2>&1 | tee "$out/serving_log.txt" | grep -v "^{" | tail -20 ;;
batching)
    timeout $limit python benchmarks/bench_serving.py --scenario batching --requests 8 --prompt-range 16384 65536 \
        --layers 8 --reps 2 --store --out "$out" 2>&1 | tee "$out/batching_log.txt" | grep -v "^{" | tail -30 ;;
*)
    echo "unknown part: $part" >&2; exit 2 ;;
esac
clock
