#!/usr/bin/env bash
# Runs ON the device machine (H200, this workplace's CUDA image), from the root of the carried work tree.
# Adapted from /work/shared/gpu/on_device.sh; asynckv comes from the work tree (src/ on PYTHONPATH).
#   bash scripts/gpu/on_device.sh stash BUNDLE_DIR        copy the parts this call carried into /tmp/parts
#   bash scripts/gpu/on_device.sh run BUNDLE_DIR CMD...   assemble vLLM 0.26.0 + wheels into /tmp/site once, run CMD
# /tmp survives between calls only while the machine is warm (30 s after each call): make the calls back to back.
# See scripts/gpu/README.md for the three calls.
set -u
mode=$1; bundle=$2; shift 2
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$mode" = stash ]; then
  mkdir -p /tmp/parts && cp "$bundle"/*/part* /tmp/parts/ && ls -la /tmp/parts; exit 0
fi
t0=$(date +%s)
mkdir -p /tmp/site
if [ ! -f /tmp/site/.vllm-done ]; then
  cat /tmp/parts/part00 /tmp/parts/part01 | xz -T0 -d | tar -x -C /tmp/site || { echo "parts missing: stash them first"; exit 2; }
  touch /tmp/site/.vllm-done
fi
if [ ! -f /tmp/site/.deps-done ] && [ -d "$bundle/deps" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/deps/*.whl \
    && touch /tmp/site/.deps-done
fi
export PYTHONPATH=$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
echo "assembled in $(( $(date +%s) - t0 )) s"
python3 -c "import vllm, torch, asynckv; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'asynckv', asynckv.__file__)"
"$@"
