#!/usr/bin/env bash
# The multi-GPU time-to-first-token table (bench_parallel.py) on one host with 4 GPUs, in two parts of under
# 10 minutes each. Rows land in <out>/g1a, g1b, g2, g4 (a bench_parallel.jsonl and a log each); append them to
# benchmarks/results/bench_parallel.jsonl, then `python benchmarks/bench_parallel.py --report` (table and plot).
#   bash benchmarks/run_parallel.sh OUT short   # 1 GPU and 2 GPUs side by side (128K-512K), then 4 GPUs at 256K
#   bash benchmarks/run_parallel.sh OUT long    # 4 GPUs at 512K and 1M
#   bash benchmarks/run_parallel.sh OUT tensor  # GPUs 0-1: tensor parallelism, then PyTorch's ring attention (dense)
set -u
out=${1:?results folder}
part=${2:-short}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || cat "$out/install.log"
bench=benchmarks/bench_parallel.py
core="pbs@0.1 pbs@0.05 sampled dense"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
case $part in
short)
    mkdir -p "$out/g1a" "$out/g1b" "$out/g2" "$out/g4"
    CUDA_VISIBLE_DEVICES=0 timeout 400 python3 $bench --lengths 131072 262144 --settings $core \
        --out "$out/g1a" > "$out/g1a/log.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=3 timeout 400 python3 $bench --lengths 131072 --settings pbs sparge bfla s2o sampled \
        --out "$out/g1b" > "$out/g1b/log.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1,2 timeout 400 torchrun --nproc-per-node 2 --master-port 29512 $bench \
        --lengths 131072 262144 524288 --dense-max 262144 --settings $core --balance pbs@0.1 \
        --out "$out/g2" > "$out/g2/log.txt" 2>&1 &
    wait
    timeout 165 torchrun --nproc-per-node 4 --master-port 29514 $bench --lengths 262144 --settings $core \
        --balance pbs@0.1 --out "$out/g4" > "$out/g4/log.txt" 2>&1
    ;;
long)
    mkdir -p "$out/g4"
    # every kernel a 1M prompt runs, compiled once into Triton's on-disk cache (what a user runs once per machine)
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -c "import sparse_compile; print('precompile seconds', \
        round(sparse_compile.precompile(1 << 20, methods=('pbs', 'sampled')), 1))" > "$out/g4/precompile.txt" 2>&1
    cat "$out/g4/precompile.txt" | tail -3
    timeout 500 torchrun --nproc-per-node 4 --master-port 29514 $bench --lengths 524288 1048576 \
        --dense-max 524288 --settings $core --balance pbs@0.1 --out "$out/g4" > "$out/g4/log.txt" 2>&1
    ;;
tensor)
    mkdir -p "$out/tp" "$out/ring"
    CUDA_VISIBLE_DEVICES=0,1 timeout 360 torchrun --nproc-per-node 2 --master-port 29516 $bench --parallel tensor \
        --lengths 131072 262144 --settings dense pbs@0.1 --balance pbs@0.1 --out "$out/tp" > "$out/tp/log.txt" 2>&1
    CUDA_VISIBLE_DEVICES=0,1 timeout 150 torchrun --nproc-per-node 2 --master-port 29518 $bench \
        --lengths 131072 262144 --settings ring --out "$out/ring" > "$out/ring/log.txt" 2>&1
    ;;
esac
for f in "$out"/*/log.txt; do echo "== $f"; grep -E '^\{|Error|error|Traceback' "$f" | tail -30; done
