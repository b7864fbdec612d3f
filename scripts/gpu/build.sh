#!/usr/bin/env bash
# Build, HERE (registry access), everything a GPU run carries to the device, into the git-ignored .gpu/:
#   .gpu/bundle/a/part00, .gpu/bundle/b/part01   vLLM 0.26.0 (CUDA 13, slimmed), xz tar split under 60 MiB
#   .gpu/bundle/deps/*.whl                       vLLM's dependencies the device image lacks, plus asynckv's
#                                                (structlog), the suite's (pytest-asyncio) and the HTTP server's
# Each folder fits in one device call's 64 MiB. asynckv itself is not bundled: it travels with the work tree.
#   usage: bash scripts/gpu/build.sh            (about 5 minutes, ~155 MB)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.gpu/ >> .git/info/exclude; }
builder=${BUILD_BUNDLE:-/work/shared/gpu/build_bundle.sh}
bash "$builder" "$root/.gpu/bundle"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/bundle/deps \
  structlog==26.1.0 pytest-asyncio==1.5.0
# What vLLM's HTTP server (serve_job.sh: `vllm serve` and `python -m asynckv.serve`) needs
# and the device image lacks, as CHECK_ONLY=1 serve_job.sh listed them (issue 29).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/bundle/deps \
  uvicorn==0.55.0 prometheus-fastapi-instrumentator==8.1.0 \
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 \
  python-multipart==0.0.34
du -sh .gpu/bundle/a .gpu/bundle/b .gpu/bundle/deps
