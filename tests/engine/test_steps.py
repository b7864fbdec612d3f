"""``engine.steps()``: one record per step taken, bounded and lossy for a slow reader."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, StepRecord
from support import unfinished

GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def _records(stream: object, n: int) -> list[StepRecord]:
    return [await anext(stream) for _ in range(n)]  # type: ignore[call-overload]


async def test_records_match_the_steps_taken(engine: AsyncEngine) -> None:
    """Every step of a request has its record: consecutive numbers, its tokens, one prefill."""
    assert await unfinished(engine) == 0
    before = engine.stats().steps
    params = SamplingParams(max_tokens=16, output_kind=RequestOutputKind.DELTA, **GREEDY)
    async with engine.steps() as steps:
        out = await engine.generate("Once upon a time", params)
        taken = engine.stats().steps - before
        records = await _records(steps, taken)
        assert steps.skipped == 0
    assert [r.step for r in records] == list(range(before + 1, before + taken + 1))
    assert sum(r.tokens for r in records) == len(out.outputs[0].token_ids) == 16
    assert sum(r.prefill for r in records) == 1
    assert sum(r.finished for r in records) == 1
    assert all(r.decode == r.requests - r.prefill and r.duration >= 0 for r in records)
    assert all(r.preemptions == 0 for r in records)  # the suite's engine has stats on
    assert all(r.running is not None for r in records if r.requests)


async def test_slow_reader_skips_without_blocking(engine: AsyncEngine) -> None:
    """A reader that reads nothing while a request runs keeps the last records, counts the rest."""
    before = engine.stats().steps
    steps = engine.steps(buffer=2)
    out = await engine.generate("A slow reader", SamplingParams(max_tokens=24, **GREEDY))
    assert len(out.outputs[0].token_ids) == 24  # the worker went on, nobody reading
    taken = engine.stats().steps - before
    kept = await _records(steps, 2)
    assert [r.step for r in kept] == [before + taken - 1, before + taken]
    assert steps.skipped == taken - 2
    await steps.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(steps)
