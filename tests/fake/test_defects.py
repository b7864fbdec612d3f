"""One test per defect of issue 13, each failing on the code before its fix.

They run on fake engines, which can be held in exactly the state each defect
needs. Every wait is bounded (``BOUND``), so a defect that hangs fails the
test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineHeldError
from fakes import FakeEngine
from model_support import BOUND, CreditEngine

LONG = SamplingParams(max_tokens=10**6)


@pytest.fixture
async def fake_engine() -> AsyncIterator[tuple[FakeEngine, AsyncEngine]]:
    """The suite's FakeEngine (one token per step, stepping freely) behind an AsyncEngine."""
    fake = FakeEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    yield fake, engine
    await asyncio.wait_for(engine.aclose(), BOUND)


@pytest.fixture
async def credit_engine() -> AsyncIterator[tuple[CreditEngine, AsyncEngine]]:
    """A fake engine that steps once per credit given, behind an AsyncEngine."""
    fake = CreditEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    await engine.run_on_engine(lambda e: None)  # the worker runs, its output hook in place
    yield fake, engine
    await asyncio.wait_for(engine.aclose(), BOUND)


async def test_wait_pause_inside_own_hold_fails_at_once(
    fake_engine: tuple[FakeEngine, AsyncEngine],
) -> None:
    """A "wait" pause inside the caller's own paused() block raises EngineHeldError, not hangs."""
    fake, engine = fake_engine
    stream = engine.generate("long", LONG)
    await engine.run_on_engine(lambda e: None)
    async with engine.paused():
        with pytest.raises(EngineHeldError):
            await asyncio.wait_for(engine.pause_generation(mode="wait"), BOUND)
        assert not await engine.is_paused()  # the refused call changed nothing
        assert fake.get_num_unfinished_requests() == 1
    await stream.aclose()


async def test_wait_pause_after_keep_fails_at_once(
    fake_engine: tuple[FakeEngine, AsyncEngine],
) -> None:
    """A "wait" pause after a "keep" pause, with a request frozen, raises EngineHeldError."""
    _, engine = fake_engine
    stream = engine.generate("long", LONG)
    await engine.run_on_engine(lambda e: None)
    await asyncio.wait_for(engine.pause_generation(mode="keep"), BOUND)
    with pytest.raises(EngineHeldError):
        await asyncio.wait_for(engine.pause_generation(mode="wait"), BOUND)
    assert await engine.is_paused()
    assert await engine.run_on_engine(lambda e: e.get_num_unfinished_requests()) == 1
    await asyncio.wait_for(engine.resume_generation(), BOUND)
    await stream.aclose()


async def test_anext_of_a_temporary_iterator_does_not_abort(
    credit_engine: tuple[CreditEngine, AsyncEngine],
) -> None:
    """``await anext(aiter(stream))`` takes one output and leaves the request running."""
    fake, engine = credit_engine
    stream = engine.generate("two tokens", SamplingParams(max_tokens=2))
    await engine.run_on_engine(lambda e: None)
    fake.credit()
    first = await asyncio.wait_for(anext(aiter(stream)), BOUND)
    assert not first.finished
    assert list(first.outputs[0].token_ids) == [0]
    fake.credit()
    final = await asyncio.wait_for(stream, BOUND)
    assert final.outputs[0].finish_reason == "length"
    assert list(final.outputs[0].token_ids) == [0, 1]


async def test_a_stream_is_its_own_async_iterator(
    credit_engine: tuple[CreditEngine, AsyncEngine],
) -> None:
    """``aiter(stream) is stream`` and ``anext(stream)`` works, as on AsyncLLM's generators."""
    fake, engine = credit_engine
    stream = engine.generate("two tokens", SamplingParams(max_tokens=2))
    assert aiter(stream) is stream
    await engine.run_on_engine(lambda e: None)
    fake.credit()
    first = await asyncio.wait_for(anext(stream), BOUND)
    assert list(first.outputs[0].token_ids) == [0]
    fake.credit()
    final = await asyncio.wait_for(stream.__anext__(), BOUND)
    assert final.finished and list(final.outputs[0].token_ids) == [0, 1]
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), BOUND)


class SilentHookEngine(FakeEngine):
    """A fake whose engine core has an output queue that never receives anything.

    So an output hook on that queue never fires, while ``step()`` computes
    normally: what a vLLM version that stopped using the queue would look like.
    """

    def __init__(self) -> None:
        super().__init__()
        self.engine_core = SimpleNamespace(shutdown=self._shutdown, outputs_queue=queue.Queue())


async def test_a_silent_output_hook_only_slows_the_worker() -> None:
    """With an output hook that never fires, requests still finish: a slowdown, not a hang."""
    fake = SilentHookEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    try:
        out = await asyncio.wait_for(engine.generate("three", SamplingParams(max_tokens=3)), BOUND)
        assert out.finished
        assert list(out.outputs[0].token_ids) == [0, 1, 2]
        assert fake.get_num_unfinished_requests() == 0
    finally:
        await asyncio.wait_for(engine.aclose(), BOUND)
