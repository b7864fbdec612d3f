"""An aborted ``n=2`` DELTA request ends with both completions marked "abort".

The fake (``model_support.CreditEngine``) steps once per credit and gives, as
vLLM's output processor does for streaming ``n > 1``, one output per child
after each step. Like vLLM's ``LLMEngine`` with no output processor to read,
it makes no abort output of its own, so the stream makes the final one.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from vllm import SamplingParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine
from model_support import BOUND, CreditEngine

DELTA = RequestOutputKind.DELTA


def _noop(_: object) -> None:
    return None


def _drain(engine: Any) -> int:
    drained: int = engine.drain()
    return drained


async def _started() -> tuple[CreditEngine, AsyncEngine]:
    fake = CreditEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    # One core output with nothing in flight: the worker has seen its hook fire
    # and from then on steps only when a credit comes (as test_model_fake does).
    await engine.run_on_engine(_noop)
    fake.credit()
    assert await engine.run_on_engine(_drain) == 1
    return fake, engine


async def _step(fake: CreditEngine, engine: AsyncEngine) -> None:
    """One productive step, its outputs on this loop's streams before it returns."""
    before = fake.productive

    def stepped() -> bool:
        with fake.cond:
            return fake.cond.wait_for(lambda: fake.productive > before, BOUND)

    fake.credit()
    assert await asyncio.to_thread(stepped), "no step after a credit"
    await engine.run_on_engine(_noop)  # answered after the step's outputs were posted


def _assert_aborted(final: RequestOutput, tokens: list[list[int]]) -> None:
    assert final.finished, final
    assert [c.index for c in final.outputs] == [0, 1], final
    assert [c.finish_reason for c in final.outputs] == ["abort", "abort"], final
    assert [list(c.token_ids) for c in final.outputs] == tokens, final


async def test_abort_after_everything_was_taken() -> None:
    """An abort after the consumer took every output ends it with both completions, as "abort"."""
    fake, engine = await _started()
    try:
        stream = engine.generate("x", SamplingParams(n=2, max_tokens=100, output_kind=DELTA))
        await _step(fake, engine)
        first = await anext(stream)
        assert [(c.index, list(c.token_ids)) for c in first.outputs] == [(0, [0]), (1, [0])]
        await engine.abort(stream.request_id)
        _assert_aborted(await anext(stream), [[], []])
    finally:
        await engine.aclose()


async def test_abort_with_merged_outputs_pending() -> None:
    """An abort while both children's deltas wait merged also marks completion 0 "abort"."""
    fake, engine = await _started()
    try:
        stream = engine.generate("x", SamplingParams(n=2, max_tokens=100, output_kind=DELTA))
        await _step(fake, engine)
        await _step(fake, engine)
        await engine.abort(stream.request_id)
        _assert_aborted(await stream, [[0, 1], [0, 1]])
    finally:
        await engine.aclose()


async def test_pause_abort_after_a_dropped_stream() -> None:
    """A "wait" pause, a drop, a step, an "abort" pause: the n=2 stream ends both as "abort"."""
    fake, engine = await _started()
    try:
        long = SamplingParams(max_tokens=100)
        kept = engine.generate("a", long)
        dropped = engine.generate("b", long)
        await _step(fake, engine)
        await _step(fake, engine)
        assert [c.token_ids for c in (await anext(dropped)).outputs] == [[0, 1]]
        delta = engine.generate("c", SamplingParams(n=2, max_tokens=2, output_kind=DELTA))
        waiting = asyncio.create_task(engine.pause_generation(mode="wait"))
        await engine.run_on_engine(_noop)  # the "wait" pause is pending
        assert not waiting.done()
        dropped_id = dropped.request_id
        del dropped
        gc.collect()
        await engine.run_on_engine(_noop)  # the drop's abort is applied
        assert dropped_id not in fake.unfinished()
        await _step(fake, engine)
        await engine.pause_generation(mode="abort")
        _assert_aborted(await delta, [[0], [0]])
        final = await kept
        assert [c.finish_reason for c in final.outputs] == ["abort"], final
        await asyncio.wait_for(waiting, BOUND)
        assert fake.unfinished() == {}
    finally:
        await engine.aclose()
