"""Every way of walking away from a stream aborts its request before the next step.

Each test ends by asking the engine, between two steps, how many requests it
still holds: the invariant is that the answer is 0. The tests marked ``anyio``
run on asyncio and on trio; the others are about asyncio's ``task.cancel()``
(their trio counterparts, cancel scopes, are in tests/engine/test_backends.py).
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from asynckv import AsyncEngine
from support import cancel_while_iterating, result, unfinished

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


async def test_cancel_mid_request(engine: AsyncEngine) -> None:
    """Cancelling the consuming task while it waits elsewhere mid-request aborts it."""
    stream = engine.generate("Cancel me while I wait", LONG)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in stream:
            first.set()
            await asyncio.get_running_loop().create_future()  # park until cancelled

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await unfinished(engine) == 0


async def test_cancel_awaited_stream(engine: AsyncEngine) -> None:
    """Cancelling ``await stream`` aborts the request."""
    stream = engine.generate("Cancel the await", LONG)
    task = asyncio.create_task(result(stream))
    await engine.run_on_engine(lambda e: None)  # the request is in the engine now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await unfinished(engine) == 0


async def test_cancel_while_iterating(engine: AsyncEngine) -> None:
    """Cancelling a task blocked in ``async for`` aborts the request."""
    await cancel_while_iterating(engine.generate("Cancel the loop", LONG))
    assert await unfinished(engine) == 0


@pytest.mark.anyio
async def test_break_out_of_a_temporary_stream_aborts(engine: AsyncEngine) -> None:
    """Breaking out of ``async for`` over ``engine.generate(...)`` drops the stream: it aborts."""
    async for out in engine.generate("Break out", LONG, request_id="break-out"):
        assert not out.finished
        break
    assert await unfinished(engine) == 0


@pytest.mark.anyio
async def test_break_out_of_a_kept_stream_leaves_it_running(engine: AsyncEngine) -> None:
    """A stream kept in a variable is its own iterator: ``break`` leaves it, ``await`` finishes it.

    As with ``AsyncLLM.generate``'s generator, leaving the loop doesn't end the
    request; ``aclose()``, ``async with`` or dropping the stream does.
    """
    stream = engine.generate("Break and resume", SamplingParams(max_tokens=40, ignore_eos=True))
    async for _ in stream:
        break
    assert aiter(stream) is stream
    final = await stream
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == 40
    assert await unfinished(engine) == 0


@pytest.mark.anyio
async def test_aclose_aborts_and_waits(engine: AsyncEngine) -> None:
    """``aclose()`` aborts and returns once the stream has ended; a second call is a no-op."""
    stream = engine.generate("Close me", LONG)
    async for _ in stream:
        await stream.aclose()
        break
    assert stream.finished
    assert await unfinished(engine) == 0
    await stream.aclose()


@pytest.mark.anyio
async def test_garbage_collected_stream_aborts_with_warning(
    engine: AsyncEngine,
) -> None:
    """A stream dropped unfinished warns with ResourceWarning and aborts its request."""
    stream = engine.generate("Forget me", LONG)
    await engine.run_on_engine(lambda e: None)  # the request is in the engine now
    with pytest.warns(ResourceWarning, match="garbage-collected unfinished"):
        del stream
        gc.collect()
    assert await unfinished(engine) == 0


@pytest.mark.anyio
async def test_explicit_abort_gives_final_abort_output(engine: AsyncEngine) -> None:
    """``engine.abort(id)`` ends the stream with a final output marked "abort"."""
    stream = engine.generate("Abort me", SamplingParams(n=2, max_tokens=400, ignore_eos=True))
    await engine.run_on_engine(lambda e: None)  # the request is in the engine now
    await engine.abort(stream.request_id)
    final = await stream
    assert final.finished
    assert [c.index for c in final.outputs] == [0, 1]
    assert all(c.finish_reason == "abort" for c in final.outputs)
    assert await unfinished(engine) == 0


@pytest.mark.anyio
async def test_abort_several_and_unknown_ids(engine: AsyncEngine) -> None:
    """Aborting several ids at once works; unknown and finished ids are no-ops."""
    done = await engine.generate("Done already", SamplingParams(max_tokens=2))
    a = engine.generate("first", LONG)
    b = engine.generate("second", LONG)
    await engine.abort([a.request_id, b.request_id, "no-such-request", done.request_id])
    outs = [await a, await b]
    assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert await unfinished(engine) == 0
    out = await engine.generate("still serving", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.anyio
async def test_abort_before_first_step(engine: AsyncEngine) -> None:
    """A request aborted in the same boundary it was added in ends with "abort" and no tokens."""
    async with engine.paused():
        stream = engine.generate("never run", LONG)
        await engine.abort(stream.request_id)
    final = await stream
    assert final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) == 0
    assert await unfinished(engine) == 0


async def test_failed_streams_leave_no_callback_on_their_task(engine: AsyncEngine) -> None:
    """A stream that ends with an error stops watching the task that consumed it."""
    callbacks: dict[str, int] = {"added": 0, "removed": 0}

    class CountingTask(asyncio.Task[None]):
        def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
            # Only the task's own code (the streams it awaits), not the test awaiting it.
            if asyncio.current_task() is self:
                callbacks["added"] += 1
            super().add_done_callback(fn, context=context)

        def remove_done_callback(self, fn: Any) -> int:
            removed = super().remove_done_callback(fn)
            callbacks["removed"] += removed
            return removed

    async def consume_failing_streams() -> None:
        for _ in range(20):
            # vLLM 0.26 (the GPU run's) raises a plain ValueError here.
            with pytest.raises((VLLMValidationError, ValueError), match="prompt cannot be empty"):
                await engine.generate({"prompt_token_ids": []}, LONG)

    task = CountingTask(consume_failing_streams())
    await task
    assert callbacks["added"] == 20
    assert callbacks["removed"] == 20
    assert await unfinished(engine) == 0
