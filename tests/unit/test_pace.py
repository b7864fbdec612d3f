"""A stream's pacing (``stream_interval``) with a fake clock: held outputs go when due, none lost.

Driven in random orders by hypothesis; the same pacing over a real engine is
pinned in tests/engine/test_stream_interval.py.
"""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import given
from hypothesis import strategies as st
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv._bridge._loops import current
from asynckv._loop._pace import Pacer
from asynckv._loop._stream import _Sink


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
