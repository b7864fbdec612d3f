"""Starting, closing and dying, each on an engine of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest
from vllm import EngineArgs, SamplingParams

from asynckv import (
    AsyncEngine,
    EngineClosedError,
    EngineDeadError,
    EngineNotStartedError,
)
from support import child_processes, engine_args, result

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def _engine_cores() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if "EngineCore" in p.name()]


def _worker_threads() -> int:
    return sum(t.name.startswith("asynckv-engine") for t in threading.enumerate())


async def test_start_serves_loop_then_close_with_requests_in_flight(
    model_path: Path,
) -> None:
    """The loop runs during start(); close ends every stream and command and leaves no process."""
    before, threads_before = child_processes(), _worker_threads()
    engine = AsyncEngine.from_engine_args(engine_args(model_path))
    with pytest.raises(EngineNotStartedError):
        engine.generate("too early")

    start = asyncio.create_task(engine.start())
    served_during_start = asyncio.Event()

    async def other_work() -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        if not start.done():
            served_during_start.set()

    await asyncio.gather(start, other_work())
    assert served_during_start.is_set()
    assert child_processes() - before  # the engine-core process exists

    streams = [engine.generate(f"in flight {i}", LONG) for i in range(10)]
    await engine.run_on_engine(lambda e: None)
    pending = [asyncio.ensure_future(engine.run_on_engine(lambda e: None)) for _ in range(5)]
    await engine.aclose()

    for stream in streams:
        with pytest.raises(EngineClosedError):
            await stream
    for command in pending:
        with contextlib.suppress(EngineClosedError):
            await command
    assert all(c.done() for c in pending)
    assert not (child_processes() - before)
    assert _worker_threads() == threads_before  # joined
    await engine.aclose()  # a no-op
    engine.shutdown()  # also a no-op
    with pytest.raises(EngineClosedError):
        engine.generate("too late")
    with pytest.raises(EngineClosedError):
        await engine.reset_prefix_cache()


async def test_killed_engine_core_fails_everything(model_path: Path) -> None:
    """SIGKILL of the engine-core process ends streams and later calls with EngineDeadError."""
    before = child_processes()
    engine = AsyncEngine.from_engine_args(engine_args(model_path))
    await engine.start()
    (core,) = {p.pid for p in _engine_cores()} - before
    streams = [engine.generate(f"doomed {i}", LONG) for i in range(20)]
    await engine.run_on_engine(lambda e: None)  # they are in the engine now
    os.kill(core, signal.SIGKILL)
    for stream in streams:
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(result(stream), timeout=10)
        assert "engine process EngineCore" in str(info.value)
        assert "killed by SIGKILL" in str(info.value)
        assert isinstance(info.value.__cause__, ChildProcessError)
    assert engine.errored
    with pytest.raises(EngineDeadError):
        engine.generate("after death")
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    await asyncio.wait_for(engine.aclose(), timeout=20)
    assert not (child_processes() - before)


async def test_start_failure_raises_the_engine_error(tmp_path: Path) -> None:
    """An engine that can't be built raises vLLM's error from start(); later calls fail fast."""
    engine = AsyncEngine.from_engine_args(EngineArgs(model=str(tmp_path / "no-such-model")))
    with pytest.raises(Exception) as info:
        await engine.start()
    assert not isinstance(info.value, EngineDeadError)
    with pytest.raises(EngineDeadError):
        engine.generate("x")
    await engine.aclose()
