"""The core API on both backends: every test here runs on asyncio and on trio.

anyio's pytest plugin runs each test once per ``anyio_backend`` (conftest.py).
Streams (tests/test_streams.py), resets and pauses (tests/test_reset_and_pause.py)
and the backend-neutral cancellation tests (tests/test_cancellation.py) run on
both backends in their own modules; this one adds what differs: trio's cancel
scopes, ``paused()`` cancelled, closing, a stream used on the wrong loop, the pool.
The tests use the shared real engine, except the close tests, which need an
engine of their own and use the fake one (a real engine takes 30-120 s to
start here; the trio example's test closes a real one, tests/test_example.py).
Each test that cancels or abandons a request ends by asking the engine, between
two steps, how many requests it still holds: the invariant is that it is 0.
"""

from __future__ import annotations

import asyncio
import gc

import anyio
import pytest
from anyio.abc import TaskStatus
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, AsyncEnginePool, EngineClosedError
from support import FakeEngine, unfinished

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0.0, "ignore_eos": True}
LONG = SamplingParams(max_tokens=400, **GREEDY)
PROMPT = "A robot may not injure a human being " * 6


def running_backend() -> str:
    """The backend this code runs on, asked of asyncio and trio themselves."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import trio

        trio.lowlevel.current_trio_token()  # raises outside a trio run
        return "trio"
    return "asyncio"


async def test_await_and_iterate(engine: AsyncEngine, anyio_backend: str) -> None:
    """Awaiting gives the final output, and DELTA iteration yields exactly its tokens."""
    assert running_backend() == anyio_backend
    awaited = await engine.generate("Call me Ishmael.", SamplingParams(max_tokens=12, **GREEDY))
    assert awaited.finished and len(awaited.outputs[0].token_ids) == 12
    delta = SamplingParams(max_tokens=12, output_kind=RequestOutputKind.DELTA, **GREEDY)
    tokens: list[int] = []
    finished = []
    async for out in engine.generate("Call me Ishmael.", delta):
        tokens.extend(out.outputs[0].token_ids)
        finished.append(out.finished)
    assert tokens == list(awaited.outputs[0].token_ids)
    assert finished[-1] and not any(finished[:-1])
    assert await unfinished(engine) == 0


async def test_async_with_exit_aborts(engine: AsyncEngine) -> None:
    """Leaving ``async with engine.generate(...)`` after one output aborts the request."""
    async with engine.generate(PROMPT, LONG) as stream:
        first = await anext(stream)
        assert not first.finished
    assert await unfinished(engine) == 0


async def test_cancel_scope_around_await_aborts(engine: AsyncEngine) -> None:
    """Cancelling the scope of a task blocked in ``await stream`` aborts the request."""
    stream = engine.generate("Cancel the await", LONG)

    async def wait(*, task_status: TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            await stream
        assert scope.cancelled_caught

    async with anyio.create_task_group() as group:
        scope = await group.start(wait)
        await engine.run_on_engine(lambda e: None)  # the request is in the engine now
        scope.cancel()
    assert await unfinished(engine) == 0


async def test_cancel_scope_while_iterating_aborts(engine: AsyncEngine) -> None:
    """Cancelling the scope of a task blocked in ``async for`` aborts the request."""
    stream = engine.generate("Cancel the loop", LONG)
    got = anyio.Event()

    async def consume(*, task_status: TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            async for _ in stream:
                got.set()

    async with anyio.create_task_group() as group:
        scope = await group.start(consume)
        await got.wait()
        scope.cancel()
    assert await unfinished(engine) == 0


async def test_cancel_scope_inside_async_with_waiting_elsewhere_aborts(
    engine: AsyncEngine,
) -> None:
    """A cancellation that finds the consumer waiting elsewhere aborts on leaving ``async with``."""
    got = anyio.Event()

    async def consume(*, task_status: TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            async with engine.generate("Cancel me while I wait", LONG) as stream:
                async for _ in stream:
                    got.set()
                    await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        scope = await group.start(consume)
        await got.wait()
        scope.cancel()
    assert await unfinished(engine) == 0


async def test_cancelled_task_drops_its_stream_and_aborts(engine: AsyncEngine) -> None:
    """A stream held only by a task cancelled while waiting elsewhere is dropped: aborted."""
    got = anyio.Event()

    async def consume() -> None:
        stream = engine.generate("Drop me", LONG)
        async for _ in stream:
            got.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        group.start_soon(consume)
        await got.wait()
        group.cancel_scope.cancel()
    gc.collect()  # the cancellation's traceback may hold the task's frame a while
    assert await unfinished(engine) == 0


async def test_cancelled_wait_for_paused_releases_the_hold(engine: AsyncEngine) -> None:
    """Cancelling a task that waits to enter ``paused()`` withdraws its hold: stepping goes on."""
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=30, **GREEDY))

    async def hold(*, task_status: TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            async with engine.paused(at_step=engine.step_count + 10_000):
                raise AssertionError("entered a hold that should have been withdrawn")

    async with anyio.create_task_group() as group:
        scope = await group.start(hold)
        await engine.run_on_engine(lambda e: None)  # the hold is at the worker now
        scope.cancel()
    assert len((await stream).outputs[0].token_ids) == 30
    async with engine.paused() as step:  # nothing holds the engine any more
        assert step == engine.step_count


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
