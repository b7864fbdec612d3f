"""The real engine against a smaller model: random interleavings on the tiny model.

A hypothesis ``RuleBasedStateMachine`` drives the session's multiprocess
engine (tests/conftest.py) from two event loops on two threads: generate (n 1
and 2, DELTA, CUMULATIVE, FINAL_ONLY, short and long), await, iterate,
``anext``, break (keeping the stream, or dropping it), cancel, ``aclose``,
abort, pauses in every mode and resume, resets, and a ``paused()`` block with
calls inside. The real engine steps by itself, so this model does not know
token by token where a request is; it knows what must have ended, what must
be parked, and what a finished output must hold. After every rule: each
stream that must have ended has, exactly once, with a final output consistent
with its parameters (``max_tokens`` tokens in each of ``n`` completions when
it ran to its length, "abort" for an unfinished completion otherwise);
parked requests, ``is_paused()`` and ``stats()`` agree with the model; and
whenever the model has nothing in flight the engine holds nothing either
(``support.unfinished(engine) == 0``). Each example leaves the shared engine
resumed and empty. Death and close are left to the fake-engine machine
(test_model_fake.py): they would cost the session its engine.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from vllm import SamplingParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, EngineHeldError, RequestStream
from model_support import (
    BOUND,
    KINDS,
    LOOP,
    PICK,
    Consumer,
    ConsumerKind,
    LoopThread,
    start_consumer,
    start_inline_break,
    wait_event,
)


@dataclass(eq=False)
class Live:
    """A request as this model sees it."""

    rid: str
    loop: int
    n: int
    kind: RequestOutputKind
    max_tokens: int
    parked: bool
    stream: RequestStream | None = None
    consumer: Consumer | None = None
    must_end: bool = False  # aborted (or its abort returned): it ends without more steps
    ended: bool = False  # a consumer took its end
    closed: bool = False  # aclose()d or dropped
    pieces: list[RequestOutput] = field(default_factory=list)


class RealEngineMachine(RuleBasedStateMachine):
    """See the module docstring."""

    engine: AsyncEngine  # the session's engine, set by the test

    def __init__(self) -> None:
        super().__init__()
        self.loops = [LoopThread("real-loop-0"), LoopThread("real-loop-1")]
        self.reqs: dict[str, Live] = {}
        self.ids = 0
        self.paused = False
        self.frozen = False

    def teardown(self) -> None:
        try:
            self._leave_clean()
        finally:
            stopped = [loop.stop() for loop in self.loops]
        assert all(stopped), "an event loop could not be stopped"

    def _leave_clean(self) -> None:
        if self.paused:
            self._call(0, self.engine.resume_generation)
            self._resumed()
        ids = [r.rid for r in self.reqs.values() if not r.must_end]
        if ids:
            self._call(0, lambda: self.engine.abort(ids))
            for rid in ids:
                self.reqs[rid].must_end = True
        for live in self.reqs.values():
            if live.stream is not None and live.consumer is None and not live.closed:
                self._start(live, "await")
        for live in self.reqs.values():
            if live.consumer is not None:
                wait_event(live.consumer.done, f"{live.rid}: its {live.consumer.kind} task ending")
        self._settle()
        assert self._call(0, lambda: _unfinished(self.engine)) == 0
        for live in self.reqs.values():
            live.stream = None

    # -- helpers ---------------------------------------------------------------------

    def _call(self, loop: int, factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        return self.loops[loop].call(factory, f"a call on loop {loop}")

    def _try(self, loop: int, factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        async def go() -> Any:
            try:
                return await factory()
            except Exception as exc:
                return exc

        return self._call(loop, go)

    def _pick(self, items: list[Live], pick: int) -> Live:
        return items[pick % len(items)]

    def _running(self) -> list[Live]:
        return [r for r in self.reqs.values() if not r.must_end and not r.parked]

    def _resumed(self) -> None:
        self.paused = self.frozen = False
        for live in self.reqs.values():
            live.parked = False

    def _abort(self, live: Live) -> None:
        live.must_end, live.parked = True, False

    def _start(self, live: Live, kind: ConsumerKind) -> None:
        assert live.stream is not None
        live.consumer = Consumer(kind)
        start_consumer(self.loops[live.loop], live.consumer, live.stream)

    # -- rules -----------------------------------------------------------------------

    @rule(
        loop=LOOP,
        n=st.sampled_from([1, 2]),
        kind=st.sampled_from(sorted(KINDS)),
        tokens=st.sampled_from([1, 4, 12, 200]),
        inline=st.sampled_from([False, False, True]),
    )
    def add_request(self, loop: int, n: int, kind: str, tokens: int, inline: bool) -> None:
        """``generate()``; ``inline``: ``async for out in engine.generate(...): break``."""
        self.ids += 1
        live = Live(f"m{self.ids}-{os.getpid()}", loop, n, KINDS[kind], tokens, self.paused)
        self.reqs[live.rid] = live
        note(f"{live.rid}: n={n} {kind} max_tokens={tokens} on loop {loop}, inline={inline}")
        params = SamplingParams(
            n=n, max_tokens=tokens, output_kind=live.kind, ignore_eos=True, seed=self.ids
        )
        engine = self.engine
        if not inline:

            async def go() -> None:
                live.stream = engine.generate("A robot may not", params, request_id=live.rid)

            self._call(loop, go)
            return
        live.consumer = start_inline_break(
            self.loops[loop], engine, "A robot may not", params, live.rid
        )

    # The real engine runs by itself, so when a consumer ends is not known; what
    # rules may run next must not depend on it (hypothesis replays the choices).
    # A consumer is taken back only once the model knows it has ended.

    def _consumable(self) -> list[Live]:
        return [
            r
            for r in self.reqs.values()
            if r.stream is not None and r.consumer is None and not r.closed
        ]

    @precondition(lambda self: self._consumable())
    @rule(pick=PICK, how=st.sampled_from(["await", "iterate", "anext", "break_keep"]))
    def consume(self, pick: int, how: ConsumerKind) -> None:
        live = self._pick(self._consumable(), pick)
        note(f"{live.rid}: {how}")
        self._start(live, how)

    def _consuming(self) -> list[Live]:
        return [r for r in self.reqs.values() if r.consumer is not None]

    @precondition(lambda self: self._consuming())
    @rule(pick=PICK)
    def cancel(self, pick: int) -> None:
        """Cancel a consuming task (it may have ended by itself meanwhile)."""
        live = self._pick(self._consuming(), pick)
        consumer = live.consumer
        assert consumer is not None and consumer.task is not None
        task = consumer.task
        note(f"{live.rid}: cancel its {consumer.kind} task")

        async def go() -> None:
            task.cancel()
            await asyncio.wait([task], timeout=BOUND)

        self._call(live.loop, go)
        wait_event(consumer.done, f"{live.rid}: the cancelled task ending")
        if consumer.cancelled:
            live.consumer, consumer.task = None, None
            live.pieces += consumer.outputs
        else:
            self._absorb(live, consumer)  # it ended before the cancellation reached it
        if not live.ended:
            self._abort(live)
        if live.stream is None:
            live.closed = True

    def _closable(self) -> list[Live]:
        return [r for r in self.reqs.values() if r.stream is not None and r.consumer is None]

    @precondition(lambda self: self._closable())
    @rule(pick=PICK, drop=st.booleans())
    def leave(self, pick: int, drop: bool) -> None:
        """``await stream.aclose()``, or drop the last reference to the stream."""
        live = self._pick(self._closable(), pick)
        note(f"{live.rid}: {'drop' if drop else 'aclose()'}")
        if drop:
            assert live.stream is not None
            ref = weakref.ref(live.stream)
            live.stream = None
            assert live.ended or ref() is None, f"test bug: {live.rid}'s stream is still held"
        else:
            stream = live.stream
            assert stream is not None
            self._call(live.loop, stream.aclose)
            del stream
        self._abort(live)
        live.closed = True

    @precondition(lambda self: self.reqs)
    @rule(loop=LOOP, picks=st.lists(PICK, min_size=1, max_size=3), unknown=st.booleans())
    def request_abort(self, loop: int, picks: list[int], unknown: bool) -> None:
        known = list(self.reqs.values())
        ids = [self._pick(known, p).rid for p in picks] + (["unknown-id"] if unknown else [])
        note(f"abort({ids}) on loop {loop}")
        self._call(loop, lambda: self.engine.abort(ids))
        for rid in ids:
            if rid in self.reqs:
                self._abort(self.reqs[rid])

    @rule(loop=LOOP, mode=st.sampled_from(["abort", "wait", "keep"]), clear=st.booleans())
    def pause(self, loop: int, mode: str, clear: bool) -> None:
        note(f"pause_generation(mode={mode!r}, clear_cache={clear}) on loop {loop}")
        held = False
        if mode == "wait" and self.frozen:
            # Frozen by "keep", nothing finishes: the count is exact.
            held = self._call(loop, lambda: _unfinished(self.engine)) > 0
        result = self._try(
            loop,
            lambda: self.engine.pause_generation(mode=mode, clear_cache=clear),  # type: ignore[arg-type]
        )
        if held:
            assert isinstance(result, EngineHeldError), result
            return
        assert result is None, result
        self.paused = True
        if mode == "abort":
            for live in self._running():
                self._abort(live)
        if mode == "wait":
            for live in self._running():
                live.must_end = True  # finished: the pause returned once they had
        self.frozen = mode == "keep" or (self.frozen and mode != "abort")

    @rule(loop=LOOP)
    def resume(self, loop: int) -> None:
        note(f"resume_generation() on loop {loop}")
        self._call(loop, self.engine.resume_generation)
        self._resumed()

    @rule(loop=LOOP, running=st.booleans())
    def reset(self, loop: int, running: bool) -> None:
        note(f"reset_prefix_cache(reset_running_requests={running}) on loop {loop}")
        result = self._call(loop, lambda: self.engine.reset_prefix_cache(running))
        assert isinstance(result, bool)
        if running or not self._running():
            assert result is True, result

    @rule(loop=LOOP, op=st.sampled_from(["count", "wait", "reset", "ahead"]))
    def inside_hold(self, loop: int, op: str) -> None:
        """A call from inside ``async with engine.paused():``."""
        note(f"{op} inside paused() on loop {loop}")
        engine = self.engine

        async def go() -> tuple[int, Any]:
            async with engine.paused() as step:
                unfinished = await _unfinished(engine)
                try:
                    if op == "wait":
                        await engine.pause_generation(mode="wait")
                    elif op == "reset":
                        await engine.reset_prefix_cache(reset_running_requests=True)
                    elif op == "ahead":
                        async with engine.paused(at_step=step + 1):
                            pass
                    else:
                        assert await _unfinished(engine) == unfinished  # held: nothing steps
                except Exception as exc:
                    return unfinished, exc
                return unfinished, None

        unfinished, error = self._call(loop, go)
        if op == "ahead" or (op == "wait" and unfinished):
            assert isinstance(error, EngineHeldError), error
        else:
            assert error is None, error
            if op == "wait":
                self.paused = True

    # -- the invariant ---------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        for loop in (0, 1):
            self._call(loop, lambda: self.engine.run_on_engine(lambda e: None))
        self._settle()
        assert self._call(0, self.engine.is_paused) is self.paused
        stats = self.engine.stats()
        parked = sum(r.parked for r in self.reqs.values())
        assert stats.requests_waiting == parked, (stats, parked)
        assert stats.requests_in_flight <= len(self._running()), stats
        if not self._running():
            assert self._call(0, lambda: _unfinished(self.engine)) == 0

    def _settle(self) -> None:
        """Take back the consumers that the model knows have ended, and check them."""
        for live in self.reqs.values():
            consumer = live.consumer
            if consumer is not None and live.must_end:
                wait_event(consumer.done, f"{live.rid}: its {consumer.kind} task ending")
                self._absorb(live, consumer)

    def _absorb(self, live: Live, consumer: Consumer) -> None:
        live.consumer, consumer.task = None, None
        what = f"{live.rid} ({consumer.kind})"
        assert consumer.error is None, f"{what}: raised {consumer.error!r}\n{consumer.trace}"
        assert not consumer.cancelled, f"{what}: cancelled unprompted"
        if consumer.result is not None:
            consumer.outputs.append(consumer.result)
        if live.ended:
            # Consumed again after its end: await gives the final output again,
            # iteration nothing (and StopAsyncIteration after it), anext StopAsyncIteration.
            if consumer.kind == "await":
                assert len(consumer.outputs) == 1 and consumer.outputs[0].finished, what
            else:
                assert not consumer.outputs and consumer.stopped == (consumer.kind == "anext"), (
                    what,
                    consumer.outputs,
                )
            return
        assert not consumer.stopped, f"{what}: StopAsyncIteration before the end"
        for out in consumer.outputs:
            assert out.request_id == live.rid, (what, out)
            assert not live.ended, f"{what}: an output after the final one: {out}"
            live.pieces.append(out)
            if out.finished:
                live.ended = True
                self._check_final(live)
        if consumer.kind in ("await", "iterate"):
            assert live.ended, f"{what}: ended without a final output"
        if consumer.kind == "iterate":
            assert consumer.after_end == "stop", f"{what}: after the end: {consumer.after_end}"
        if consumer.kind == "inline_break":
            self._abort(live)
            live.closed = True

    def _check_final(self, live: Live) -> None:
        """The pieces a stream gave, final included, agree with its parameters."""
        final = live.pieces[-1]
        what = f"{live.rid} (n={live.n}, {live.kind.name}, {live.max_tokens}): {final}"
        reasons: dict[int, str | None] = {}
        counts: dict[int, int] = {}
        for out in live.pieces:
            for c in out.outputs:
                assert 0 <= c.index < live.n, what
                reasons[c.index] = c.finish_reason
                if live.kind is RequestOutputKind.DELTA:
                    counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
                else:
                    assert len(c.token_ids) >= counts.get(c.index, 0), what
                    counts[c.index] = len(c.token_ids)
        if live.kind is RequestOutputKind.FINAL_ONLY:
            assert len(live.pieces) == 1, what
        for index in range(live.n):
            reason = reasons.get(index)
            assert reason in ("length", "abort"), f"{what}: completion {index} ended {reason}"
            if reason == "length":
                assert counts.get(index) == live.max_tokens, f"{what}: {counts}"
            else:
                assert live.must_end, f"{what}: aborted, but nothing aborted it"
                assert counts.get(index, 0) <= live.max_tokens, f"{what}: {counts}"


async def _unfinished(engine: AsyncEngine) -> int:
    count: int = await engine.run_on_engine(lambda e: e.get_num_unfinished_requests())
    return count


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_real_engine_agrees_with_the_model(engine: AsyncEngine) -> None:
    """Random interleavings on the tiny model end every stream as the model says."""
    RealEngineMachine.engine = engine
    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    run_state_machine_as_test(RealEngineMachine, settings=settings.get_profile(f"{profile}-engine"))
