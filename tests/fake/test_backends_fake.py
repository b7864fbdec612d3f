"""The core API on both backends over fake engines: a stream on the wrong loop, closing, the pool.

Every test here runs on asyncio and on trio (anyio's plugin, conftest.py); the
real engine's side is in tests/engine/test_backends.py.
"""

from __future__ import annotations

import anyio
import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, AsyncEnginePool, EngineClosedError
from fakes import FakeEngine
from support import running_backend

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def test_stream_on_another_loop_raises() -> None:
    """A stream iterated from a run of the other backend, in another thread, raises RuntimeError."""
    fake = FakeEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    try:
        stream = engine.generate("mine", SamplingParams(max_tokens=3))
        other = "trio" if running_backend() == "asyncio" else "asyncio"

        async def take() -> object:
            return await anext(stream)

        with pytest.raises(RuntimeError, match="belongs to another event loop"):
            await anyio.to_thread.run_sync(lambda: anyio.run(take, backend=other))
        assert len((await stream).outputs[0].token_ids) == 3
    finally:
        await engine.aclose()


async def test_aclose_ends_everything_in_flight() -> None:
    """``aclose()`` ends streams and commands in flight with EngineClosedError; later calls fail."""
    fake = FakeEngine()
    fake.gate.clear()  # the worker is held inside its first step
    engine = AsyncEngine(fake, freeze_gc=False)
    streams = [engine.generate(f"in flight {i}", SamplingParams(max_tokens=5)) for i in range(3)]
    assert await anyio.to_thread.run_sync(fake.step_entered.wait, 30)
    errors: list[BaseException] = []

    async def command() -> None:
        # Never answered by the held worker: the close fails it (or refuses it).
        try:
            await engine.run_on_engine(lambda e: None)
        except EngineClosedError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as group:
        group.start_soon(command)
        group.start_soon(engine.aclose)
        for stream in streams:
            with pytest.raises(EngineClosedError):
                await stream
        fake.gate.set()  # out of its step, the worker sees the close and aclose joins it
    assert len(errors) == 1
    assert fake.shut_down.is_set()
    await engine.aclose()  # a no-op
    with pytest.raises(EngineClosedError):
        engine.generate("too late")
    with pytest.raises(EngineClosedError):
        await engine.reset_prefix_cache()


async def test_cancelled_async_with_still_closes_the_engine() -> None:
    """Leaving ``async with engine:`` by a cancel scope's cancellation closes the engine first."""
    fake = FakeEngine()
    with anyio.CancelScope() as scope:
        async with AsyncEngine(fake, freeze_gc=False) as engine:
            stream = engine.generate("cut short", SamplingParams(max_tokens=10**9))
            await anext(stream)
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert fake.shut_down.is_set()
    with pytest.raises(EngineClosedError):
        await stream


async def test_pool_on_both_backends() -> None:
    """A pool fans out generate, abort, reset and pause over its engines through task groups."""
    fakes = [FakeEngine(), FakeEngine()]
    pool = AsyncEnginePool([AsyncEngine(fake, freeze_gc=False) for fake in fakes])
    async with pool:
        streams = [pool.generate(f"r{i}", SamplingParams(max_tokens=4)) for i in range(4)]
        long = pool.generate("long", SamplingParams(max_tokens=10**9))
        await pool.abort(long.request_id)
        assert (await long).outputs[0].finish_reason == "abort"
        assert [len((await s).outputs[0].token_ids) for s in streams] == [4, 4, 4, 4]
        assert await pool.reset_prefix_cache() == [True, True]
        await pool.pause_generation(mode="wait")
        assert await pool.is_paused()
        await pool.resume_generation()
    assert all(fake.shut_down.is_set() for fake in fakes)
