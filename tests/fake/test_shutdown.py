"""Closing with and without a drain (vLLM's ``--shutdown-timeout``), over the fake engine."""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineClosedError
from fakes import FakeEngine


async def test_drain_finishes_admitted_requests_and_refuses_new_ones() -> None:
    """During a drain the request in flight runs to its end while a new one is refused at once
    with EngineClosedError(draining=True); then the core is stopped with no grace (vllm serve's)."""
    fake = FakeEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    fake.gate.clear()  # the worker stops inside its first step, the request admitted
    admitted = engine.generate("admitted", SamplingParams(max_tokens=8))
    assert await asyncio.to_thread(fake.step_entered.wait, 10)
    closing = asyncio.create_task(engine.aclose(drain=60))
    refused = None
    for _ in range(1000):  # until the closing thread has begun the drain
        await asyncio.sleep(0.01)
        with pytest.raises(EngineClosedError) as caught:
            engine.generate("late", SamplingParams(max_tokens=8))
        if caught.value.draining:
            refused = caught.value
            break
    assert refused is not None and "shutting down" in str(refused)
    fake.gate.set()
    final = await admitted
    assert final.finished and len(final.outputs[0].token_ids) == 8
    await asyncio.wait_for(closing, 30)
    assert fake.shutdown_timeout == 0.0
    with pytest.raises(EngineClosedError) as after:
        engine.generate("later", SamplingParams(max_tokens=8))
    assert not after.value.draining


async def test_close_without_drain_ends_the_stream_at_once() -> None:
    """Without a drain a stream in flight ends with EngineClosedError (not draining)."""
    fake = FakeEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    stream = engine.generate("cut", SamplingParams(max_tokens=10**9))
    await anext(stream)
    await engine.aclose()
    with pytest.raises(EngineClosedError) as caught:
        await stream
    assert not caught.value.draining
    assert fake.shutdown_timeout == 0.0
