"""Faults at exact moments, with a fake engine that blocks or raises on demand.

These add to the real-engine tests; they cover what a real engine can't be
made to do at a chosen moment.
"""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineClosedError, EngineDeadError
from fakes import FakeEngine, hold_in_next_step

LONG = SamplingParams(max_tokens=10_000)


async def test_step_exception_kills_the_engine() -> None:
    """An exception out of step() ends every stream and command with EngineDeadError."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    streams = [engine.generate(f"r{i}", LONG) for i in range(5)]
    await hold_in_next_step(engine, fake)
    queued = asyncio.ensure_future(engine.run_on_engine(lambda e: None))
    await asyncio.sleep(0)  # let the command reach the inbox
    fake.fail_with = MemoryError("the model ran out of memory")
    fake.gate.set()

    for stream in streams:
        with pytest.raises(
            EngineDeadError, match="MemoryError: the model ran out of memory"
        ) as info:
            await stream
        assert isinstance(info.value.__cause__, MemoryError)
    with pytest.raises(EngineDeadError):
        await queued
    with pytest.raises(EngineDeadError):
        engine.generate("after")
    assert engine.errored
    await asyncio.wait_for(engine.aclose(), timeout=10)
    assert fake.shut_down.is_set()


async def test_close_returns_while_step_is_stuck() -> None:
    """aclose() returns within its timeout even with the worker stuck inside step()."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    stream = engine.generate("stuck", LONG)
    await hold_in_next_step(engine, fake)
    queued = asyncio.ensure_future(engine.run_on_engine(lambda e: None))
    await asyncio.sleep(0)

    await asyncio.wait_for(engine.aclose(timeout=0.5), timeout=10)
    with pytest.raises(EngineClosedError):
        await stream
    with pytest.raises(EngineClosedError):
        await queued
    fake.gate.set()  # let the abandoned worker finish
    await asyncio.to_thread(fake.shut_down.wait, 10)
    assert fake.shut_down.is_set()


async def test_commands_apply_in_order_between_steps() -> None:
    """Commands issued while a step runs are applied after it, in the order issued."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    first = engine.generate("a", LONG, request_id="a")
    await hold_in_next_step(engine, fake)
    fake.log.clear()
    second = engine.generate("b", SamplingParams(max_tokens=2), request_id="b")
    await asyncio.sleep(0)
    aborted = asyncio.ensure_future(engine.abort("a"))
    await asyncio.sleep(0)
    fake.gate.set()
    await aborted
    assert fake.log[:3] == ["step", "add b", "abort a"]
    assert (await second).finished
    final = await first
    assert final.finished and final.outputs[0].finish_reason == "abort"
    await engine.aclose()
