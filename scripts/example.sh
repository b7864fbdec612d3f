#!/usr/bin/env bash
# Set up this checkout from nothing and run the async reset-KV example on the demo model.
#
#   scripts/example.sh [EXAMPLE.py] [ARGS]
#
# Makes (or reuses) a virtual environment in .venv, installs asynckv with vLLM
# for CPUs and trio (scripts/setup.sh cpu,trio), then runs examples/reset_kv_async.py,
# or the example named first (examples/reset_kv_trio.py, say). The first run also
# trains and caches the demo model. The other arguments go to the example: any
# vLLM engine flag, e.g. --model PATH for a local checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

example=examples/reset_kv_async.py
if [[ "${1:-}" == *.py ]]; then
    example=$1
    shift
fi
extras=cpu,trio
source scripts/setup.sh
# vLLM logs to stdout; keep only its errors unless asked for more.
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR}
exec "$py" "$example" "$@"
