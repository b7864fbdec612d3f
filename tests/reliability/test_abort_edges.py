"""Edges of abort: before admission, floods of ids, and an abort racing the final step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from vllm import SamplingParams

from asynckv import AsyncEngine
from fakes import FakeEngine
from support import unfinished


async def test_cancelled_before_admission(
    engine: AsyncEngine, figures: Callable[[str], None]
) -> None:
    """500 handlers cancelled right after generate(), before consuming: nothing is retained.

    The handlers hold their streams in ``async with``, which aborts on any exit.
    """
    began = time.monotonic()
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    parked = asyncio.Event()

    async def handler(i: int) -> None:
        async with engine.generate(f"gone {i}", params) as stream:
            await parked.wait()  # cancelled here, before it consumes anything
            await stream

    tasks = [asyncio.create_task(handler(i)) for i in range(500)]
    await asyncio.sleep(0)  # every handler has called generate()
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert cancelled == 500
    assert await unfinished(engine) == 0
    assert engine.stats().requests_in_flight == 0
    figures(f"500 requests cancelled before admission, {time.monotonic() - began:.1f} s")


async def test_abort_flood(engine: AsyncEngine, figures: Callable[[str], None]) -> None:
    """5,000 abort() calls mixing live, finished, unknown and repeated ids raise nothing."""
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    live = [engine.generate(f"live {i}", params) for i in range(20)]
    done = await engine.generate("finished", SamplingParams(max_tokens=1))
    ids = [s.request_id for s in live] + [done.request_id, "unknown-a", "unknown-b"]
    began = time.monotonic()
    await asyncio.gather(*(engine.abort(ids[i % len(ids)]) for i in range(5000)))
    seconds = time.monotonic() - began
    finals = [await s for s in live]
    assert all(f.outputs[0].finish_reason == "abort" for f in finals)
    probe = await engine.generate("probe", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(probe.outputs[0].token_ids) == 3
    assert await unfinished(engine) == 0
    figures(f"5000 aborts over {len(ids)} ids in {seconds:.2f} s, probe served")


async def test_abort_during_final_step(figures: Callable[[str], None]) -> None:
    """An abort landing while the request's final step runs: exactly one terminal event."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    endings = {"final output": 0, "abort output": 0}
    for i in range(50):
        fake.gate.clear()
        fake.step_entered.clear()
        stream = engine.generate(f"last {i}", SamplingParams(max_tokens=1))
        assert await asyncio.to_thread(fake.step_entered.wait, 10)  # inside its only step
        aborted = asyncio.ensure_future(engine.abort(stream.request_id))
        await asyncio.sleep(0)  # the abort is in the inbox, behind the step
        fake.gate.set()
        await aborted
        outputs = [out async for out in stream]
        finals = [o for o in outputs if o.finished]
        assert len(finals) == 1, outputs
        reason = finals[0].outputs[0].finish_reason
        endings["abort output" if reason == "abort" else "final output"] += 1
    await engine.aclose()
    assert sum(endings.values()) == 50
    figures(f"50 aborts racing the final step: {endings}")
