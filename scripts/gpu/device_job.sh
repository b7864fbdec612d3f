#!/usr/bin/env bash
# The GPU benchmark of issue 9, ON the device, through on_device.sh run (vLLM + asynckv on the path):
#   bash scripts/gpu/on_device.sh run .gpu/bundle bash scripts/gpu/device_job.sh [bench args...]
# raw LLMEngine loop / AsyncLLM / asynckv, interleaved, with the 8B-shaped dummy model (CUDA graphs
# on unless --enforce-eager is passed). Everything lands in $OUT; bench.json is written after each
# size, so a run cut short keeps the sizes it finished.
set -u -o pipefail
OUT=${OUT:-results/gpu}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
nproc | tee -a "$OUT/gpu.txt"
# Leave time under the device's 600 s limit to write the logs back.
timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench.py --model scripts/gpu/llama8b --load-format dummy \
  --skip-tokenizer-init --gpu-memory-utilization 0.25 --max-num-seqs 256 --out "$OUT/bench" "$@" 2>&1 \
  | tee "$OUT/bench-full.log" | grep --line-buffered -v " INFO \| DEBUG " | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
echo "bench exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
