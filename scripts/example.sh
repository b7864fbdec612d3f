#!/usr/bin/env bash
# Set up this checkout from nothing and run the async reset-KV example on the demo model.
#
# Makes (or reuses) a virtual environment in .venv, installs asynckv with vLLM
# for CPUs, then runs examples/reset_kv_async.py. The first run also trains
# and caches the demo model (about 15 s on two cores). Arguments go to the
# example: any vLLM engine flag, e.g. --model PATH for a local checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${ASYNCKV_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"

"$py" -m pip install --quiet --disable-pip-version-check -e '.[cpu]' 2> >(grep -v "^WARNING: Location" >&2)
# See scripts/test.sh: these CUDA builds break `import vllm` beside the CPU torch.
"$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vLLM logs to stdout; keep only its errors unless asked for more.
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR}
exec "$py" examples/reset_kv_async.py "$@"
