"""``stream_interval``: coalescing on the loop, the first and final outputs at once, nothing lost.

The real-engine tests run on asyncio and on trio; the interval there is an
hour, so it can never pass during a test and what is coalesced is exact
without any clock. The pacing itself is pinned with a fake clock on the
stream's buffer, and driven in random orders by hypothesis.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine
from asynckv._bridge._loops import current
from asynckv._loop._pace import Pacer
from asynckv._loop._sink import _Sink
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


# -- the pacing itself, with a fake clock -------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _delta(token: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "", [token], None, None, "length" if finished else None)
    return RequestOutput("r", None, [1], None, [completion], finished)


def _paced_sink(clock: _Clock, interval: float) -> _Sink:
    sink = _Sink(current(), "r", RequestOutputKind.DELTA, 1, interval)
    sink.pacer = Pacer(interval, clock)
    return sink


async def test_held_output_goes_when_due() -> None:
    """Outputs within the interval are merged and held until it passes; the final goes at once."""
    clock = _Clock()
    sink = _paced_sink(clock, 1.0)
    sink.push(_delta(0))
    first = sink.take()
    assert first is not None and first.outputs[0].token_ids == [0]
    clock.now += 0.2
    sink.push(_delta(1))
    clock.now += 0.2
    sink.push(_delta(2))
    assert sink.take() is None  # held: 0.4 s of the 1 s interval
    clock.now += 0.6
    merged = sink.take()
    assert merged is not None and merged.outputs[0].token_ids == [1, 2]
    clock.now += 0.1
    sink.push(_delta(3, finished=True))
    final = sink.take()
    assert final is not None and final.finished and final.outputs[0].token_ids == [3]


async def test_waiting_consumer_woken_when_held_output_is_due() -> None:
    """A consumer waiting on a held output is woken by the interval, with no further push."""
    clock = _Clock()
    sink = _paced_sink(clock, 1.0)
    sink.push(_delta(0))
    assert sink.take() is not None
    sink.push(_delta(1))
    assert sink.take() is None
    clock.now += 1.0  # due now: the wait's timer is 0 s
    await asyncio.wait_for(sink.wait(), 30)
    out = sink.take()
    assert out is not None and out.outputs[0].token_ids == [1]


class _RecordingPacer(Pacer):
    """A pacer that records when it released an output, and whether for a final one."""

    def __init__(self, interval: float, clock: _Clock) -> None:
        super().__init__(interval, clock)
        self.clock = clock
        self.releases: list[tuple[float, bool]] = []
        self.final = False

    def arrived(self, final: bool) -> bool:
        self.final = final
        return super().arrived(final)

    def due(self) -> bool:
        self.final = False
        return super().due()

    def release(self) -> None:
        self.releases.append((self.clock.now, self.final))
        super().release()


@given(st.lists(st.tuples(st.floats(0.0, 0.3), st.booleans()), min_size=1, max_size=40))
def test_paced_sink_model(events: list[tuple[float, bool]]) -> None:
    """Any pushes and takes at any times: every token once, in order; releases an interval apart."""

    async def run() -> None:
        clock = _Clock()
        sink = _Sink(current(), "r", RequestOutputKind.DELTA, 1, 0.25)
        sink.pacer = pacer = _RecordingPacer(0.25, clock)
        taken: list[int] = []
        for i, (gap, take) in enumerate(events):
            clock.now += gap
            last = i == len(events) - 1
            sink.push(_delta(i, finished=last))
            if take or last:
                out = sink.take()
                if out is not None:
                    taken.extend(out.outputs[0].token_ids)
        assert taken == list(range(len(events)))
        times = [t for t, final in pacer.releases if not final]
        assert all(b - a >= 0.25 for a, b in itertools.pairwise(times))

    asyncio.run(run())
