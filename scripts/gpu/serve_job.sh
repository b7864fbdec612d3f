#!/usr/bin/env bash
# The server benchmark of issue 15, ON the device, through on_device.sh run (vLLM + asynckv on the path):
#   bash scripts/gpu/on_device.sh run .gpu/bundle bash scripts/gpu/serve_job.sh [benchmarks/serve.py args...]
# `vllm serve` (python -m vllm.entrypoints.openai.api_server) against `python -m asynckv.serve`, both on the
# 8B-shaped dummy model (random weights) with a tokenizer of its vocabulary built here (scripts/gpu/tokenizer.py),
# driven by vLLM's own benchmark client: random dataset, 128 in / 64 out, --ignore-eos, concurrency 1 16 64
# 256, 3 interleaved repetitions, medians. Both servers stay up side by side on the one GPU (0.35 of its
# memory each) while the other is measured. Everything lands in $OUT: serve.json, serve.png, the servers' and
# the client's logs. `CHECK_ONLY=1` stops after the import check and the tokenizer (seconds, no GPU work).
set -u -o pipefail
OUT=${OUT:-results/gpu}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# What the two servers and the client import beyond vLLM's engine (earlier GPU runs used none of it).
python3 - <<'EOF' 2>&1 | tee "$OUT/imports.txt"
import importlib, sys
names = ["uvicorn", "uvloop", "fastapi", "prometheus_client", "prometheus_fastapi_instrumentator",
         "aiohttp", "PIL", "tqdm", "openai", "tokenizers",
         "vllm.benchmarks.serve", "vllm.entrypoints.openai.api_server", "asynckv.serve"]
missing = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:  # an ImportError, or a module failing at import
        missing.append(f"{name}: {type(exc).__name__}: {exc}")
print("\n".join(missing) or "all imports ok")
sys.exit(3 if missing else 0)
EOF
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "missing modules: add their wheels to scripts/gpu/build.sh (exit $rc)"; exit "$rc"; }
model=/tmp/llama8b-tok
python3 scripts/gpu/tokenizer.py scripts/gpu/llama8b "$model" | tee -a "$OUT/bench.log" || exit 4
[ -z "${CHECK_ONLY:-}" ] || { echo "check only: done after $(( $(date +%s) - t0 )) s"; exit 0; }
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--concurrency 1 16 64 256 --reps 3)
# Leave time under the device's 600 s limit to write the logs back.
timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/serve.py --model "$model" --input-len 128 --output-len 64 \
  --out "$OUT/serve" "${args[@]}" -- --load-format dummy --gpu-memory-utilization 0.35 \
  --max-model-len 1024 --max-num-seqs 256 2>&1 | tee "$OUT/bench-full.log" \
  | grep --line-buffered -v " INFO \| DEBUG " | tee -a "$OUT/bench.log"
rc=${PIPESTATUS[0]}
echo "serve bench exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
exit "$rc"
