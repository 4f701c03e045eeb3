#!/usr/bin/env bash
# The H100 session's device calls, one part per call (each well inside the 10-minute limit):
#   bash benchmarks/run_h100_session.sh "$OUT" check     # GPU tests (~7 min)
#   bash benchmarks/run_h100_session.sh "$OUT" check-verify  # never-slower check at defaults (~5 min)
#   bash benchmarks/run_h100_session.sh "$OUT" e2e       # whole-model TTFT at defaults, 8K-64K (~8 min)
#   bash benchmarks/run_h100_session.sh "$OUT" e2e-long  # the same at 128K, plus the density-0.1 rows (~8 min)
#   bash benchmarks/run_h100_session.sh "$OUT" table     # re-measure the break-even table, peak memory (~7 min)
#   bash benchmarks/run_h100_session.sh "$OUT" train     # train the retrieval model (~9.5 min)
#   bash benchmarks/run_h100_session.sh "$OUT" s2o       # Hopper kernel tests, per-tile costs, S2O's table (~8 min)
#   bash benchmarks/run_h100_session.sh "$OUT" s2o-parts # S2O's kernel tests, where its time goes, direct and queued
#   bash benchmarks/run_h100_session.sh "$OUT" s2o-table # S2O's break-even entry, --verify at defaults, peak memory
#   bash benchmarks/run_h100_session.sh "$OUT" s2o-profile  # Nsight Compute counters: S2O's walks vs dense, 64K
#   bash benchmarks/run_h100_session.sh "$OUT" s2o-sweep  # a kernels.hopper constant's values (SWEEP_CONSTANT,
#                                                        # SWEEP_VALUES) timed on dense, window pass and walk
#   bash benchmarks/run_h100_session.sh "$OUT" sampled   # the sampled selector: GPU tests, its break-even entry,
#                                                        # --verify, retrieval at 16K-64K (SAMPLED_PARAMS: --method-params JSON)
set -uo pipefail
out=${1:?results folder}
part=${2:?part: check, check-verify, e2e, e2e-long, table, train, s2o, s2o-parts, s2o-profile, s2o-sweep, s2o-table or sampled}
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
clock() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$out/gpu.txt"; }
clock
case "$part" in
check)  # the GPU tests alone now take ~6.5 min (49 tests): verify in a call of its own (check-verify)
    timeout 560 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -30 > "$out/gpu_tests.txt"
    tail -3 "$out/gpu_tests.txt" ;;
check-verify)
    # the README's command: queued, so that the host is ahead of the GPU as inside a forward pass (unqueued, each
    # sample's first call shows the Python dispatch: 1.03-1.10x at 8K, results/breakeven_verify_unqueued_s16.md)
    timeout 560 python benchmarks/bench_breakeven.py --verify --calls 4 --reps 7 --queue-ahead --out "$out" 2>&1 \
        | tee "$out/breakeven_log.txt" | grep -v "^{" | tail -50 ;;
e2e)
    timeout 560 python benchmarks/bench_e2e.py --lengths 8192 16384 32768 65536 --budget-lengths --skip-eager \
        --reps 3 --out "$out" 2>&1 | tee "$out/e2e_log.txt" | grep -v "^{" | tail -40 ;;
e2e-long)
    timeout 560 python benchmarks/bench_e2e.py --lengths 131072 --budgets 0.1 --budget-lengths 131072 --skip-eager \
        --reps 2 --name e2e_long --out "$out" 2>&1 | tee "$out/e2e_long_log.txt" | grep -v "^{" | tail -40 ;;
table)
    timeout 560 python benchmarks/bench_breakeven.py --measure --memory --reps 5 --out "$out" 2>&1 \
        | tee "$out/breakeven_log.txt" | grep -v "^{" | tail -40
    cp sparse_compile/breakeven_tables.json "$out/" ;;
train)
    timeout 590 python benchmarks/train_small_lm.py --retrieval --out-dir "$out" $TRAIN_ARGS 2>&1 \
        | tee "$out/retrieval_lm_train_log.txt" | grep -v "^step" | tail -20 ;;
s2o)
    timeout 240 python -m pytest -q -m gpu tests/test_kernel.py -k "hopper or early_stop" -p no:cacheprovider 2>&1 \
        | tail -30 > "$out/gpu_tests_hopper.txt"
    tail -5 "$out/gpu_tests_hopper.txt"
    timeout 240 python benchmarks/bench_breakeven.py --tiles --lengths 32768 65536 131072 --reps 5 --out "$out" \
        ${TILE_METHODS:+--methods $TILE_METHODS} 2>&1 | tee "$out/tiles_log.txt" | grep -v "^{" | tail -20
    timeout 100 python benchmarks/bench_breakeven.py --measure --methods s2o --reps 5 --out "$out" 2>&1 \
        | tee "$out/breakeven_log.txt" | grep -v "^{" | tail -12
    cp sparse_compile/breakeven_tables.json "$out/"
    timeout 60 python benchmarks/bench_breakeven.py --measure --methods s2o --lengths 32768 --reps 7 --queue-ahead \
        --table "$out/queued_table.json" --name s2o_queued --out "$out" 2>&1 | grep -v "^{" | tail -5
    timeout 200 python benchmarks/bench_breakeven.py --verify --methods s2o --calls 4 --reps 7 --queue-ahead \
        --name breakeven_s2o --out "$out" 2>&1 | grep -v "^{" | tail -16 ;;
s2o-parts)
    timeout 240 python -m pytest -q -m gpu tests/test_kernel.py tests/test_selection_fast.py -p no:cacheprovider \
        -k "hopper or early_stop or gathered or s2o or agreement or pass" 2>&1 | tail -30 > "$out/gpu_tests_s2o.txt"
    tail -3 "$out/gpu_tests_s2o.txt"
    for queue in ${S2O_QUEUES:-direct queued}; do
        timeout 200 python benchmarks/bench_breakeven.py --s2o-parts --lengths 32768 65536 131072 --reps 5 \
            --name "s2o_$queue" --out "$out" $([ $queue = queued ] && echo --queue-ahead 10000000) 2>&1 \
            | tee "$out/s2o_parts_$queue.txt" | grep -v "^{" | tail -8
    done ;;
s2o-profile)
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    timeout 500 "$ncu" --profile-from-start off --clock-control none --set full --import-source no \
        -k regex:_hopper_fwd -o "$out/s2o_profile" python benchmarks/profile_s2o.py --length ${PROFILE_LENGTH:-65536} \
        2>&1 | tail -20 | tee "$out/s2o_profile_log.txt"
    "$ncu" -i "$out/s2o_profile.ncu-rep" --page details --csv > "$out/s2o_profile_details.csv" 2>&1
    "$ncu" -i "$out/s2o_profile.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$out/s2o_profile_sass.csv.gz"
    ls -la "$out" ;;
s2o-sweep)
    timeout 560 python benchmarks/profile_s2o.py --time ${SWEEP_VALUES:-0 1 2} --constant ${SWEEP_CONSTANT:-PINGPONG} \
        --lengths ${SWEEP_LENGTHS:-16384 32768 65536} --reps ${SWEEP_REPS:-7} --out "$out" 2>&1 \
        | tee "$out/sweep_log.txt" | tail -20 ;;
s2o-table)
    timeout 150 python benchmarks/bench_breakeven.py --measure --methods s2o --reps 5 --queue-ahead --name s2o \
        --out "$out" 2>&1 | tee "$out/breakeven_log.txt" | grep -v "^{" | tail -10
    cp sparse_compile/breakeven_tables.json "$out/"
    timeout 220 python benchmarks/bench_breakeven.py --verify --methods s2o --calls 4 --reps 7 --queue-ahead \
        --name breakeven_s2o --out "$out" 2>&1 | grep -v "^{" | tail -16
    timeout 150 python benchmarks/bench_breakeven.py --memory --methods pbs s2o --name s2o --out "$out" 2>&1 \
        | grep -v "^{" | tail -12 ;;
sampled)
    timeout 150 python -m pytest -q -m gpu tests/test_selection_fast.py tests/test_kernel.py -p no:cacheprovider \
        -k "sampled" 2>&1 | tail -30 > "$out/gpu_tests_sampled.txt"
    tail -3 "$out/gpu_tests_sampled.txt"
    timeout 150 python benchmarks/bench_breakeven.py --measure --methods sampled --lengths 8192 16384 32768 65536 131072 \
        --reps 5 --queue-ahead --name sampled --out "$out" 2>&1 | grep -v "^{" | tail -8
    cp sparse_compile/breakeven_tables.json "$out/"
    timeout 150 python benchmarks/bench_breakeven.py --verify --methods sampled --calls 4 --reps 5 --queue-ahead \
        --name breakeven_sampled --out "$out" 2>&1 | grep -v "^{" | tail -14
    timeout 250 python benchmarks/bench_retrieval.py --methods sampled --densities 0.05 0.1 0.2 0.3 --calibrate-errors \
        --coverage 2 --method-params "${SAMPLED_PARAMS:-{\}}" --name "retrieval_${SAMPLED_NAME:-sampled}" \
        --out "$out" 2>&1 | grep -v "^{" | tail -30 ;;
esac
clock
