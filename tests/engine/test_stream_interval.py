"""``stream_interval``: coalescing on the loop, the first and final outputs at once, nothing lost.

The real-engine tests run on asyncio and on trio; the interval there is an
hour, so it can never pass during a test and what is coalesced is exact
without any clock. The pacing itself, with a fake clock on the stream's
buffer, is pinned in tests/unit/test_pace.py.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine
from support import unfinished

HOUR = 3600.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "It was the best of times, it was the worst of times,"


def _params(kind: RequestOutputKind, tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, output_kind=kind, **GREEDY)


async def _collect(
    engine: AsyncEngine, params: SamplingParams, stream_interval: float | None = None
) -> list[RequestOutput]:
    stream = engine.generate(PROMPT, params, stream_interval=stream_interval)
    return [out async for out in stream]


@pytest.mark.anyio
async def test_delta_coalesced_into_first_and_final(engine: AsyncEngine) -> None:
    """DELTA, an hour's interval: the first output alone, then one merged final; no token lost."""
    reference = await engine.generate(PROMPT, _params(RequestOutputKind.FINAL_ONLY))
    outs = await _collect(engine, _params(RequestOutputKind.DELTA), stream_interval=HOUR)
    assert len(outs) == 2
    assert not outs[0].finished and outs[1].finished
    tokens = [t for out in outs for t in out.outputs[0].token_ids]
    assert tokens == list(reference.outputs[0].token_ids)
    assert await unfinished(engine) == 0


@pytest.mark.anyio
async def test_cumulative_replaced_by_the_latest(engine: AsyncEngine) -> None:
    """CUMULATIVE with an hour's interval: the first output, then the final one with every token."""
    reference = await engine.generate(PROMPT, _params(RequestOutputKind.FINAL_ONLY))
    outs = await _collect(engine, _params(RequestOutputKind.CUMULATIVE), stream_interval=HOUR)
    assert len(outs) == 2
    assert list(outs[-1].outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert outs[-1].outputs[0].text == reference.outputs[0].text


def test_engine_default_is_checked_when_set(engine: AsyncEngine) -> None:
    """Setting the engine-wide default checks it as ``generate`` checks its own."""
    default = engine.stream_interval
    with pytest.raises(ValueError, match="stream_interval"):
        engine.stream_interval = -1.0
    with pytest.raises(TypeError, match="stream_interval"):
        engine.stream_interval = "fast"  # type: ignore[assignment]
    assert engine.stream_interval == default


@pytest.mark.anyio
async def test_engine_default_applies_and_zero_overrides(engine: AsyncEngine) -> None:
    """The engine-wide default paces every stream; ``stream_interval=0`` opts one out."""
    default = engine.stream_interval
    engine.stream_interval = HOUR
    try:
        paced = await _collect(engine, _params(RequestOutputKind.DELTA, 12))
        plain = await _collect(engine, _params(RequestOutputKind.DELTA, 12), stream_interval=0)
    finally:
        engine.stream_interval = default
    assert len(paced) == 2
    assert len(plain) > 2  # one per step, but where two steps reached the loop in one batch
    assert sum(len(o.outputs[0].token_ids) for o in plain) == 12


@pytest.mark.anyio
async def test_awaited_paced_stream_returns_every_token(engine: AsyncEngine) -> None:
    """Awaiting a paced DELTA stream returns the final output with every token."""
    out = await engine.generate(PROMPT, _params(RequestOutputKind.DELTA), stream_interval=HOUR)
    assert out.finished and len(out.outputs[0].token_ids) == 24


@pytest.mark.anyio
async def test_abort_of_a_held_stream_ends_it_at_once(engine: AsyncEngine) -> None:
    """An abort while an output is held ends the stream at once with a final output."""
    stream = engine.generate(PROMPT, _params(RequestOutputKind.DELTA, 400), stream_interval=HOUR)
    first = await anext(stream)
    await engine.abort(stream.request_id)
    rest = [out async for out in stream]
    assert len(rest) == 1 and rest[0].finished
    assert rest[0].outputs[0].finish_reason == "abort"
    assert len(first.outputs[0].token_ids) >= 1
    assert await unfinished(engine) == 0


@pytest.mark.parametrize(
    ("bad", "error"), [(-1.0, ValueError), (float("inf"), ValueError), ("1", TypeError)]
)
async def test_bad_interval_fails_at_once(engine: AsyncEngine, bad: object, error: type) -> None:
    """A negative, infinite or non-numeric interval raises from ``generate`` itself."""
    with pytest.raises(error):
        engine.generate(PROMPT, _params(RequestOutputKind.DELTA), stream_interval=bad)  # type: ignore[arg-type]
