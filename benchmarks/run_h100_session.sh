#!/usr/bin/env bash
# One device call: GPU tests, the break-even table, the never-slower check and the memory table (H100, ~7 min).
#   bash benchmarks/run_h100_session.sh "$OUT"
set -uo pipefail
out=${1:?results folder}
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$out/gpu.txt"
timeout 170 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -25 | tee "$out/gpu_tests.txt"
timeout 280 python benchmarks/bench_breakeven.py --measure --verify --memory --reps 5 --out "$out" 2>&1 | tee "$out/breakeven_log.txt" | grep -v "^{" | tail -60
cp sparse_compile/breakeven_tables.json "$out/" 2>/dev/null
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$out/gpu.txt"
