"""The swap under vLLM's own AsyncLLM tests (runs on the tests' event loop; CI never loads it).

scripts/vllm_tests.py copies vLLM's test files next to this conftest and runs
them once per backend (``VLLM_TESTS_BACKEND``). The tests stay vLLM's; only the
engine they get changes:

* ``asynckv``: ``AsyncLLM.from_engine_args(args, ...)`` returns asynckv's
  ``AsyncEngine`` over ``LLMEngine.from_engine_args(args, ...)`` (the same
  arguments), built at once as ``AsyncLLM``'s constructor builds. The three
  things vLLM's tests read that only ``AsyncLLM`` has are answered from
  asynckv's own API (``_Ported`` below): ``output_processor.
  has_unfinished_requests()`` from ``stats().requests_in_flight``,
  ``engine_core.pause_scheduler_async``/``resume_scheduler_async`` as utility
  calls to the core from the worker (in FIFO order behind an abort, which is
  what the test uses them for), ``logger_manager`` from the ``LLMEngine``.
* ``asyncllm``: vLLM's own ``AsyncLLM``.

On both, an engine built from plain arguments (no ``stat_loggers``, no KV
connector) is built once and shared by the tests that ask for the same
arguments; its ``shutdown()`` waits for the end of the run, and after each test
a pause it left is resumed. vLLM's tests build one per test: 40 builds of 70 s
each on two cores, which is what the sharing saves.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from vllm.v1.engine.async_llm import AsyncLLM

from asynckv import AsyncEngine

BACKEND = os.environ.get("VLLM_TESTS_BACKEND", "asynckv")
_BUILD_ASYNC_LLM = AsyncLLM.from_engine_args.__func__  # type: ignore[attr-defined]
_SHARED: dict[str, Any] = {}


class _Unfinished:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def has_unfinished_requests(self) -> bool:
        return self._engine.stats().requests_in_flight > 0


class _CoreCalls:
    """``AsyncLLM.engine_core``'s scheduler calls, made on asynckv's worker."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._engine.run_on_engine(
            lambda e: e.engine_core.call_utility("pause_scheduler", mode, clear_cache)
        )

    async def resume_scheduler_async(self) -> None:
        await self._engine.run_on_engine(lambda e: e.engine_core.call_utility("resume_scheduler"))


class _Ported(AsyncEngine):
    """asynckv's engine, with the three ``AsyncLLM`` attributes vLLM's tests read."""

    def __init__(self, llm_engine: Any) -> None:
        super().__init__(llm_engine)
        self._llm_engine = llm_engine

    @property
    def output_processor(self) -> _Unfinished:
        return _Unfinished(self)

    @property
    def engine_core(self) -> _CoreCalls:
        return _CoreCalls(self)

    @property
    def logger_manager(self) -> Any:
        # Read across threads: the stat loggers are set once at build time.
        return self._llm_engine.logger_manager


def _build(engine_args: Any, *args: Any, **kwargs: Any) -> Any:
    if BACKEND == "asyncllm":
        return _BUILD_ASYNC_LLM(AsyncLLM, engine_args, *args, **kwargs)
    from vllm import LLMEngine

    kwargs.pop("start_engine_loop", None)
    return _Ported(LLMEngine.from_engine_args(engine_args, **kwargs))


def _from_engine_args(cls: type, engine_args: Any, *args: Any, **kwargs: Any) -> Any:
    plain = not args and not kwargs and engine_args.kv_transfer_config is None
    key = repr(engine_args)
    if plain and key in _SHARED:
        return _SHARED[key]
    engine = _build(engine_args, *args, **kwargs)
    if plain:
        _SHARED[key] = engine
        engine.shutdown_at_end = engine.shutdown
        engine.shutdown = lambda *a, **k: None  # the run's end shuts it down
    return engine


AsyncLLM.from_engine_args = classmethod(_from_engine_args)  # type: ignore[method-assign,assignment]


@pytest.fixture(autouse=True)
async def _resume_shared() -> AsyncIterator[None]:
    yield
    for engine in _SHARED.values():
        if await engine.is_paused():
            await engine.resume_generation()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for engine in _SHARED.values():
        engine.shutdown_at_end()
