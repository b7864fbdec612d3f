"""``engine.steps()`` over a fake engine: the reader's stream ends with the engine's death."""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineDeadError, StepRecord
from fakes import FakeEngine


async def _records(stream: object, n: int) -> list[StepRecord]:
    return [await anext(stream) for _ in range(n)]  # type: ignore[call-overload]


async def test_steps_end_with_the_engine() -> None:
    """Closing the engine ends iteration; a dead engine raises EngineDeadError from it."""
    closing = AsyncEngine(FakeEngine())
    steps = closing.steps()
    await closing.generate("x", SamplingParams(max_tokens=3))
    records = await _records(steps, 3)
    # The fake has no output processor to tap: counts come from step()'s outputs.
    assert [r.finished for r in records] == [0, 0, 1]
    await closing.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(steps)

    fake = FakeEngine()
    dying = AsyncEngine(fake)
    steps = dying.steps()
    fake.fail_with = MemoryError("gone")
    with pytest.raises(EngineDeadError):
        await dying.generate("y", SamplingParams(max_tokens=3))
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(anext(steps), 30)
    await dying.aclose()
