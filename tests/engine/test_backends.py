"""The core API on both backends: every test here runs on asyncio and on trio.

anyio's pytest plugin runs each test once per ``anyio_backend`` (conftest.py).
Streams (tests/engine/test_streams.py), resets and pauses (tests/engine/test_reset_and_pause.py)
and the backend-neutral cancellation tests (tests/engine/test_cancellation.py) run on
both backends in their own modules; this one adds what differs: trio's cancel
scopes, ``paused()`` cancelled, closing, a stream used on the wrong loop, the pool.
The tests use the shared real engine, except the close tests, which need an
engine of their own and use the fake one (a real engine takes 30-120 s to
start here; the trio example's test closes a real one, tests/engine/test_example.py).
Each test that cancels or abandons a request ends by asking the engine, between
two steps, how many requests it still holds: the invariant is that it is 0.
"""

from __future__ import annotations

import gc

import anyio
import pytest
from anyio.abc import TaskStatus
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine
from support import running_backend, unfinished

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0.0, "ignore_eos": True}
LONG = SamplingParams(max_tokens=400, **GREEDY)
PROMPT = "A robot may not injure a human being " * 6


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
