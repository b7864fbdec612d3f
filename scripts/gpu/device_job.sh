#!/usr/bin/env bash
# The GPU run of issue 9, ON the device, through on_device.sh run (vLLM + asynckv on the path):
#   bash scripts/gpu/on_device.sh run .gpu/bundle bash scripts/gpu/device_job.sh [bench args...]
# 1. the benchmark (raw / AsyncLLM / asynckv, interleaved) with the 8B-shaped dummy model;
# 2. the asynckv smoke test (generate, 64 streams, abort, reset under load) on the same kind of engine.
# Everything lands in $OUT (bench.json/.png written after each size, so a run cut short keeps its sizes).
set -u -o pipefail
OUT=${OUT:-results/gpu}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/bench.py --model scripts/gpu/llama8b --load-format dummy --skip-tokenizer-init \
  --gpu-memory-utilization 0.25 --max-num-seqs 256 --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
python3 scripts/gpu/smoke.py --eager 2>&1 | tee "$OUT/smoke.log"
echo "job done after $(( $(date +%s) - t0 )) s"
