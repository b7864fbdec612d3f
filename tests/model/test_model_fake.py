"""The engine against a model: random interleavings from two event loops on two threads.

A hypothesis ``RuleBasedStateMachine`` drives ``AsyncEngine(CreditEngine())``
(tests/model/model_support.py: a fake engine that steps once per credit the test
gives) through its public API from two event loops, each running on a thread
of its own, and keeps a model of what the engine must then hold. Rules:
generate (n 1 and 2, DELTA, CUMULATIVE, FINAL_ONLY, short and endless), the
ways of consuming and leaving a stream (await, iterate, ``anext``, break,
``aclose``, drop, cancel), abort of known and unknown ids, holds
(``paused(at_step=...)``, held by a task and released by a later rule, with
commands issued from inside the block), ``pause_generation`` in every mode and
``resume_generation``, resets and ``run_on_engine`` in bursts, engine steps,
and the three ends: a step that raises, an engine-core death (a utility call
raising vLLM's ``EngineDeadError``, or the fake core process killed under the
watchdog), and ``aclose()``. After an end the machine checks the engine's
post-mortem answers and starts a fresh engine (``restart``), so one run may
cover several lifetimes.

Half the lifetimes have a ``RestartPolicy`` (``max_restarts`` 1 or 2, with
``rebuild=`` building a fresh ``CreditEngine``), and a ``kill`` rule, drawn
like any other, kills the engine in the same three ways. Within the policy
the model predicts a restart: ``stats().restarts`` counts it and
``check_health()`` passes after; every request the engine held continues
(a streaming one that was sent tokens resumes from its last token, so its
stream shows every token once; a FINAL_ONLY one, or one sent nothing, runs
again from its prompt), parked requests stay parked, a pause or hold in
place stays in place, and the call that met the dead core is applied again
on the new one. A gated rebuild (the rebuild waits for the test) shows
``check_health()`` raising ``EngineRestartingError`` meanwhile and a call
issued then waiting in the inbox until the new engine serves it. The death
beyond the policy ends everything with ``EngineDeadError`` naming every
death.

After every rule it checks that the engine agrees with the model: the
requests the engine holds (asked between two steps), ``stats()`` and
``is_paused()``, that every consumer, hold and pending pause has completed if
and only if the model says it can, with the outcome the model predicts (each
stream ends once, with a final output consistent with the tokens the fake
produced, or with the documented error), that each loop's commands were
answered and applied in the order it issued them, and that no step ran while
the model says none could. Every wait is bounded (``ASYNCKV_MODEL_BOUND``,
10 s): a call that takes longer is a hang, and fails.

``ASYNCKV_MODEL_AVOID`` (comma-separated, for exploring past a known bug;
empty in CI) keeps the machine from generating some inputs: ``anext``
(``anext(stream)``, ``anext(aiter(stream))`` and break-and-keep),
``held_wait`` (a "wait" pause that the model says must fail with
``EngineHeldError``, and ``paused(at_step=k)`` from inside the caller's own
block), ``n2delta`` (n=2 with DELTA).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

from asynckv import (
    AsyncEngine,
    EngineClosedError,
    EngineDeadError,
    EngineHeldError,
    EngineRestartingError,
    RequestStream,
    RestartPolicy,
)
from model_support import (
    BOUND,
    KINDS,
    LOOP,
    PICK,
    ConsumerKind,
    CreditEngine,
    FakeCoreProcess,
    Hang,
    LoopThread,
    Req,
    Result,
    StreamRules,
    feed,
    held_tokens,
    names,
    start_inline_break,
    wait,
    wait_event,
)

AVOID = frozenset(filter(None, os.environ.get("ASYNCKV_MODEL_AVOID", "").split(",")))
LONG = 10**6  # tokens: a request that never finishes by itself
RESTARTS = st.sampled_from([None, None, 1, 2])  # a lifetime's RestartPolicy.max_restarts
MIN_AGE = 12  # rules in a lifetime before it may end
MAX_HOLDS = 2  # holds at once (active or pending): more would stop the stepping for good
CONSUMERS: list[ConsumerKind] = ["await", "iterate"]
if "anext" not in AVOID:
    CONSUMERS += ["anext", "anext_aiter", "break_keep"]


@dataclass(eq=False)
class HoldRec:
    """A task holding ``engine.paused(at_step)`` until released; it runs ops in its block."""

    hid: int
    loop: int
    at_step: int | None
    state: Literal["pending", "active"]
    expect_step: int | None = None
    expect_error: type[BaseException] | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    entered_step: int | None = None
    error: BaseException | None = None
    cancelled: bool = False
    ops: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class WaitRec:
    """A ``pause_generation(mode="wait")`` that the model says must wait."""

    loop: int
    clear: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None
    due: bool = False
    expect_error: type[BaseException] | None = None
    task: asyncio.Task[None] | None = None


class EngineMachine(StreamRules):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.loops = [LoopThread("model-loop-0"), LoopThread("model-loop-1")]
        self.processes: list[FakeCoreProcess] = []
        self.phase: Literal["none", "alive", "dead", "closed"] = "none"
        self.ids = 0
        self.lifetimes = 0
        # Per loop: sequence numbers of answered commands, appended on that loop.
        self.issued = [0, 0]
        self.answers: list[list[int]] = [[], []]

    # -- lifetimes -----------------------------------------------------------------

    @initialize(process=st.booleans(), restarts=RESTARTS)
    def start(self, process: bool, restarts: int | None) -> None:
        self._start(process, restarts)

    def _start(self, process: bool, restarts: int | None) -> None:
        proc = FakeCoreProcess() if process else None
        if proc is not None:
            self.processes.append(proc)
        self.process = proc
        self.fake = CreditEngine(proc)
        self.policy = restarts
        self.deaths: list[str] = []
        self.planned = 0  # planned restarts (engine.restart()): counted, but no death
        self.steps_base = 0  # the model's step count when this fake came in
        self.rebuilt: list[tuple[CreditEngine, FakeCoreProcess | None]] = []
        self.building, self.built = threading.Event(), threading.Event()
        self.gate: threading.Event | None = None
        if restarts is None:
            self.engine = AsyncEngine(self.fake, freeze_gc=False)
        else:
            policy = RestartPolicy(max_restarts=restarts, window=3600.0)
            self.engine = AsyncEngine(
                self.fake, freeze_gc=False, rebuild=self._rebuild, restart=policy
            )
        self.lifetimes += 1
        note(f"-- engine {self.lifetimes} (core process: {process}, restarts: {restarts})")
        self.phase = "alive"
        self.age = 0
        self.cause = ""
        self.paused = False
        self.frozen = False
        self.reqs: dict[str, Req] = {}
        self.holds: list[HoldRec] = []
        self.waits: list[WaitRec] = []
        self.steps = 0
        self.finished = 0
        self.aborted = 0
        self.parked_aborts = 0
        self.resets = (0, 0)
        self.applied_seen = 0
        # Answered once the worker runs its loop, with its output hook in place.
        for i in (0, 1):
            self._noop(i)
        # One core output with nothing in flight shows the worker that the hook works
        # (before it has seen the hook fire, the worker steps without waiting for one).
        self.fake.credit()
        drained = self._run(0, lambda: self.engine.run_on_engine(_drain), "drain", False)
        assert drained.value == 1, drained

    def _finish(self) -> None:
        """End this lifetime: close, then check that everything ended as the model says."""
        if self.phase == "alive":
            self._run(0, lambda: self.engine.aclose(), "aclose", record=False)
            self._closed()
        elif self.phase == "dead":
            self._run(0, lambda: self.engine.aclose(), "aclose after death", record=False)
        self._settle()
        for hold in [h for h in self.holds if h.state == "active"]:
            self._release(hold)
        for req in self.reqs.values():
            if req.stream is not None and not req.consumed_end and not req.closed:
                self._start_consumer(req, "await")
        self._settle()
        wait_event(self.fake.shut_down, "the engine core's shutdown")
        assert not self.fake.violations, self.fake.violations
        for req in self.reqs.values():
            req.stream = None

    def _rebuild(self) -> CreditEngine:
        """The ``rebuild`` of a lifetime with a policy (on the worker thread)."""
        self.building.set()
        gate = self.gate
        if gate is not None and not gate.wait(BOUND):
            raise Hang("hang: the gated rebuild was never released")
        proc = FakeCoreProcess() if self.process is not None else None
        if proc is not None:
            self.processes.append(proc)
        fake = CreditEngine(proc, primed=False)
        self.rebuilt.append((fake, proc))
        self.built.set()
        return fake

    def teardown(self) -> None:
        try:
            if self.phase != "none":
                self._finish()
        finally:
            stopped = [loop.stop() for loop in self.loops]
            for proc in self.processes:
                proc.dispose()
        assert all(stopped), "an event loop could not be stopped"

    # -- helpers -------------------------------------------------------------------

    def _rid(self) -> str:
        self.ids += 1
        return f"r{self.ids}"

    def _run(
        self,
        loop: int,
        factory: Callable[[], Coroutine[Any, Any, Any]],
        what: str,
        record: bool = True,
    ) -> Result:
        """Run a call on ``loop``, bounded; record its answer in that loop's order."""
        return wait(self._submit(loop, factory, record), f"{what} on loop {loop}")

    def _submit(
        self, loop: int, factory: Callable[[], Coroutine[Any, Any, Any]], record: bool = True
    ) -> concurrent.futures.Future[Result]:
        """Start a call on ``loop``; its answer is recorded in that loop's order."""
        seq = self.issued[loop]
        self.issued[loop] += 1
        answers = self.answers[loop]

        async def go() -> Result:
            try:
                return Result(value=await factory())
            except Exception as exc:
                return Result(error=exc)
            finally:
                if record:
                    answers.append(seq)

        return self.loops[loop].submit(go())

    def _noop(self, loop: int) -> None:
        result = self._run(loop, lambda: self.engine.run_on_engine(_noop), "barrier", False)
        assert result.error is None, result.error

    def _gone(self) -> type[BaseException]:
        return EngineDeadError if self.phase == "dead" else EngineClosedError

    def _expect(self, result: Result, what: str, error: type[BaseException] | None) -> None:
        if error is None:
            assert result.error is None, f"{what} raised {result.error!r}"
        else:
            assert isinstance(result.error, error), (
                f"{what}: expected {error.__name__}, got {result.error!r} / {result.value!r}"
            )
            if isinstance(result.error, EngineDeadError):
                names(result.error, self.cause)

    def _running(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.state == "running"]

    def _active(self) -> list[HoldRec]:
        return [h for h in self.holds if h.state == "active"]

    def _can_step(self) -> bool:
        return bool(self._running()) and not self.frozen and not self._active()

    def _limits(self) -> None:
        """Tell the fake which steps the model says cannot run now."""
        if self._active():
            self.fake.forbidden = "a paused() block holds the engine"
        elif self.frozen:
            self.fake.forbidden = 'a "keep" pause freezes the requests'
        else:
            self.fake.forbidden = None
        pending = [h.at_step for h in self.holds if h.state == "pending"]
        self.fake.ceiling = min(s for s in pending if s is not None) if pending else None

    def _new(self, loop: int, n: int, kind: str, tokens: int) -> Req:
        if "n2delta" in AVOID and kind == "delta":
            n = 1
        req = Req(
            self._rid(),
            loop,
            n,
            KINDS[kind],
            tokens,
            "parked" if self.paused else "running",
        )
        self.reqs[req.rid] = req
        note(f"{req.rid}: n={n} {kind} max_tokens={tokens} on loop {loop} ({req.state})")
        return req

    def _params(self, req: Req) -> SamplingParams:
        return SamplingParams(n=req.n, max_tokens=req.max_tokens, output_kind=req.kind)

    # -- model transitions -----------------------------------------------------------

    def _abort(self, req: Req, drain: bool = True) -> None:
        if req.state == "running":
            req.end_tokens = req.tokens
            self.finished += 1
            self.aborted += 1
        elif req.state == "parked":
            req.end_tokens = 0
            self.parked_aborts += 1
        else:
            return
        req.state, req.outcome, req.unread = "ended", "abort", True
        note(f"{req.rid}: aborted at {req.end_tokens} tokens")
        feed(req)
        if drain and not self._running():
            self._drained(False)

    def _drained(self, clearing: bool) -> None:
        """Nothing is in flight: every pending "wait" pause returns (and may reset).

        ``clearing``: the command that drained the engine resets the cache too.
        Resets asked for at one boundary may be merged into one.
        """
        pending = [w for w in self.waits if not w.due]
        if not pending and not clearing:
            return
        clears = sum(w.clear for w in pending) + clearing
        lo, hi = self.resets
        self.resets = (lo + (clears > 0), hi + clears)
        for w in pending:
            w.due = True

    def _pause(self, mode: str, clear: bool, own: bool) -> Literal["ok", "held", "pending"]:
        running = self._running()
        if mode == "abort":
            self.paused, self.frozen = True, False
            for req in running:
                self._abort(req, drain=False)
            self._drained(clear)
        elif mode == "wait":
            if running and (self.frozen or own):
                return "held"
            self.paused = True
            if running:
                return "pending"
            self._drained(clear)
        else:
            self.paused, self.frozen = True, True
            lo, hi = self.resets
            self.resets = (lo + clear, hi + clear)
        self._limits()
        return "ok"

    def _resume(self) -> None:
        if not self.paused:
            return
        self.paused, self.frozen = False, False
        lo, hi = self.resets
        pending = [w for w in self.waits if not w.due]
        self.resets = (lo, hi + sum(w.clear for w in pending))
        for w in pending:
            w.due = True
        for req in self.reqs.values():
            if req.state == "parked":
                req.state = "running"
        self._limits()

    def _on_step(self, productive: bool) -> None:
        self.steps += 1
        if productive:
            for req in self._running():
                req.tokens += 1
                if req.streaming:
                    req.unread = True
                if req.tokens >= req.max_tokens:
                    req.state, req.outcome, req.unread = "ended", "length", True
                    req.end_tokens = req.tokens
                    self.finished += 1
                feed(req)
        for hold in self.holds:
            if hold.state == "pending" and hold.at_step == self.steps:
                hold.state, hold.expect_step = "active", self.steps
                note(f"hold {hold.hid}: entered after step {self.steps}")
        # A stream iterated by `async for out in engine.generate(...): break`
        # is dropped at its first output: aborted at once.
        for req in self._running():
            consumer = req.consumer
            if consumer is not None and consumer.kind == "inline_break" and consumer.due:
                self._abort(req)
        if productive and not self._running():
            self._drained(False)
        self._limits()

    def _end_all(self, outcome: str, error: type[BaseException]) -> None:
        for req in self.reqs.values():
            if req.state != "ended":
                req.state, req.outcome, req.unread = "ended", outcome, True
                req.cause, req.end_tokens = self.cause, req.tokens
                feed(req)
        for hold in self.holds:
            if hold.state == "pending":
                hold.expect_error = error
        for w in self.waits:
            if not w.due:
                w.due, w.expect_error = True, error
        self.fake.forbidden, self.fake.ceiling = None, None

    def _die(self, cause: str) -> None:
        note(f"-- engine {self.lifetimes} dies: {cause}")
        self.phase, self.cause = "dead", cause
        self._end_all("dead", EngineDeadError)

    def _closed(self) -> None:
        note(f"-- engine {self.lifetimes} closed")
        self.phase = "closed"
        self._end_all("closed", EngineClosedError)

    # -- requests --------------------------------------------------------------------

    @precondition(lambda self: self.phase == "alive")
    @rule(
        loop=LOOP,
        n=st.sampled_from([1, 2]),
        kind=st.sampled_from(sorted(KINDS)),
        tokens=st.sampled_from([1, 2, 3, LONG]),
        inline=st.sampled_from([False, False, True]),
        more=st.integers(0, 2),
    )
    def add_request(
        self, loop: int, n: int, kind: str, tokens: int, inline: bool, more: int
    ) -> None:
        """``generate()``; ``inline``: ``async for out in engine.generate(...): break``.

        ``more``: as many other requests (CUMULATIVE, short) after it, at once.
        """
        self._generate(loop, n, kind, tokens, inline)
        if more:
            reqs = [self._new(loop, 1, "cumulative", 1 + i) for i in range(more)]
            engine = self.engine

            async def go() -> None:
                for req in reqs:
                    req.stream = engine.generate("prompt", self._params(req), request_id=req.rid)

            self._expect(self._run(loop, go, "generate", record=False), "generate", None)

    def _generate(self, loop: int, n: int, kind: str, tokens: int, inline: bool) -> None:
        req = self._new(loop, n, kind, tokens)
        params = self._params(req)
        engine = self.engine
        if not inline:

            async def go() -> None:
                # Kept here, not returned: a finished task keeps its result alive a while.
                req.stream = engine.generate("prompt", params, request_id=req.rid)

            self._expect(self._run(loop, go, "generate", record=False), "generate", None)
            return
        note(f"{req.rid}: async for out in engine.generate(...): break")
        req.consumer = start_inline_break(self.loops[loop], engine, "prompt", params, req.rid)

    def _aclose(self, loop: int, stream: RequestStream) -> Result:
        return self._run(loop, stream.aclose, "stream.aclose()", record=False)

    def _settled(self) -> None:
        self._limits()

    @precondition(lambda self: self._consumable())
    @rule(pick=PICK, how=st.sampled_from(CONSUMERS))
    def consume(self, pick: int, how: ConsumerKind) -> None:
        req = self._pick(self._consumable(), pick)
        note(f"{req.rid}: {how}")
        self._start_consumer(req, how)

    @precondition(lambda self: self._closable())
    @rule(pick=PICK)
    def drop(self, pick: int) -> None:
        """Delete the last reference to a stream: an unfinished request is aborted."""
        req = self._pick(self._closable(), pick)
        note(f"{req.rid}: drop the stream")
        assert req.stream is not None
        ref = weakref.ref(req.stream)
        req.stream = None
        if req.state != "ended":
            # Only the stream of a live request must be gone (an ended one may live on in
            # the traceback of the error it raised, which other streams share).
            assert ref() is None, f"test bug: {req.rid}'s stream is held by {_holders(ref())}"
        self._abort(req)
        req.closed = True

    @precondition(lambda self: self.phase == "alive" and self.reqs)
    @rule(loop=LOOP, picks=st.lists(PICK, max_size=3), unknown=st.booleans())
    def request_abort(self, loop: int, picks: list[int], unknown: bool) -> None:
        """``abort()`` of known ids (live, parked or ended) and unknown ones."""
        known = list(self.reqs.values())
        ids = [self._pick(known, p).rid for p in picks] if known else []
        if unknown or not ids:
            ids.append(f"unknown-{self.ids}")
        note(f"abort({ids}) on loop {loop}")
        arg: str | list[str] = ids[0] if len(ids) == 1 else ids
        result = self._run(loop, lambda: self.engine.abort(arg), "abort")
        self._expect(result, "abort", None)
        for rid in ids:
            if rid in self.reqs:
                self._abort(self.reqs[rid])
        self._limits()

    # -- commands between steps -----------------------------------------------------

    @precondition(lambda self: self.phase == "alive")
    @rule(
        loop=LOOP,
        ops=st.lists(
            st.sampled_from(["call", "raise", "unknown", "abort", "reset"]), min_size=1, max_size=5
        ),
        both=st.booleans(),
        pick=PICK,
    )
    def burst(self, loop: int, ops: list[str], both: bool, pick: int) -> None:
        """Commands issued at once from one loop (or both): answered and applied in order."""
        if both:
            ops = [op for op in ops if op in ("call", "raise", "unknown")] or ["call"]
        plans: dict[int, list[tuple[str, int, str | None]]] = {}
        for i in (0, 1) if both else (loop,):
            plan = []
            for op in ops:
                seq = self.issued[i]
                self.issued[i] += 1
                target = None
                if op == "abort":
                    live = [r for r in self.reqs.values() if r.state != "ended"]
                    target = self._pick(live, pick).rid if live else None
                plan.append((op, seq, target))
            plans[i] = plan
        note(f"burst {plans}")
        futures = {i: self.loops[i].submit(self._burst(i, plan)) for i, plan in plans.items()}
        results = {i: wait(f, f"a burst on loop {i}") for i, f in futures.items()}
        for i, plan in plans.items():
            for (op, seq, target), result in zip(plan, results[i], strict=True):
                what = f"{op} #{seq} on loop {i}"
                if op == "call":
                    self._expect(result, what, None)
                    assert result.value == seq, (what, result.value)
                elif op == "raise":
                    assert isinstance(result.error, ValueError), (what, result)
                    assert str(result.error) == f"raised by #{seq}", (what, result.error)
                elif op == "reset":
                    self._expect(result, what, None)
                    assert result.value is (not self._running()), (what, result.value)
                    lo, hi = self.resets
                    self.resets = (lo + 1, hi + 1)
                else:
                    self._expect(result, what, None)
                    if target is not None:
                        self._abort(self.reqs[target])
        self._limits()

    async def _burst(self, loop: int, plan: list[tuple[str, int, str | None]]) -> list[Result]:
        answers = self.answers[loop]
        applied = self.fake.applied

        async def one(op: str, seq: int, target: str | None) -> Result:
            def record(_: object) -> int:
                applied.append((loop, seq))
                return seq

            def fail(_: object) -> None:
                applied.append((loop, seq))
                raise ValueError(f"raised by #{seq}")

            try:
                if op == "call":
                    return Result(await self.engine.run_on_engine(record))
                if op == "raise":
                    return Result(await self.engine.run_on_engine(fail))
                if op == "reset":
                    return Result(await self.engine.reset_prefix_cache())
                await self.engine.abort(target or f"unknown-{seq}")
                return Result()
            except Exception as exc:
                return Result(error=exc)
            finally:
                answers.append(seq)

        # Tasks start in creation order, so the commands reach the inbox in plan order.
        tasks = [asyncio.create_task(one(*step)) for step in plan]
        return list(await asyncio.gather(*tasks))

    @precondition(lambda self: self.phase == "alive")
    @rule(loop=LOOP, mode=st.sampled_from(["abort", "wait", "keep"]), clear=st.booleans())
    def pause(self, loop: int, mode: str, clear: bool) -> None:
        if mode == "wait" and "held_wait" in AVOID and self._running() and self.frozen:
            mode = "abort"
        note(f"pause_generation(mode={mode!r}, clear_cache={clear}) on loop {loop}")
        expected = self._pause(mode, clear, own=False)
        if expected == "pending":
            self._pending_wait(loop, clear)
            return
        result = self._run(
            loop,
            lambda: self.engine.pause_generation(mode=mode, clear_cache=clear),  # type: ignore[arg-type]
            "pause_generation",
        )
        self._expect(
            result, f"pause_generation({mode})", EngineHeldError if expected == "held" else None
        )

    def _pending_wait(self, loop: int, clear: bool) -> None:
        record = WaitRec(loop, clear)
        self.waits.append(record)
        engine = self.engine

        async def body() -> None:
            try:
                await engine.pause_generation(mode="wait", clear_cache=clear)
                record.result = Result()
            except Exception as exc:
                record.result = Result(error=exc)
            finally:
                record.done.set()

        async def start() -> None:
            record.task = asyncio.create_task(body())

        self.loops[loop].call(start, "starting a wait pause")
        note(f"   (waits for {[r.rid for r in self._running()]})")

    @precondition(lambda self: self.phase == "alive" and self.paused)
    @rule(loop=LOOP)
    def resume(self, loop: int) -> None:
        note(f"resume_generation() on loop {loop}")
        self._resume()
        result = self._run(loop, self.engine.resume_generation, "resume_generation")
        self._expect(result, "resume_generation", None)

    @precondition(lambda self: self.phase == "alive" and self.paused)
    @rule(loop=LOOP)
    def resume_again(self, loop: int) -> None:
        """The same as ``resume``: a second rule, so that pauses do not last forever."""
        self.resume(loop)

    # -- holds -----------------------------------------------------------------------

    @precondition(lambda self: self.phase == "alive" and len(self.holds) < MAX_HOLDS)
    @rule(
        loop=LOOP,
        at=st.sampled_from(["next", "now", "past", "ahead", "ahead"]),
        ahead=st.integers(1, 3),
    )
    def hold(self, loop: int, at: str, ahead: int) -> None:
        """``async with engine.paused(at_step=...)`` in a task, held until a later rule."""
        if at == "past" and self.steps == 0:
            at = "now"
        at_step = {
            "next": None,
            "now": self.steps,
            "past": self.steps - 1,
            "ahead": self.steps + ahead,
        }[at]
        if at == "past":
            note(f"paused(at_step={at_step}) on loop {loop}: passed")
            result = self._run(loop, lambda: _enter(self.engine, at_step), "paused(passed step)")
            self._expect(result, "paused(at_step=passed)", ValueError)
            return
        hold = HoldRec(len(self.holds), loop, at_step, "pending" if at == "ahead" else "active")
        note(f"hold {hold.hid}: paused(at_step={at_step}) on loop {loop}")
        if hold.state == "active":
            hold.expect_step = self.steps
        self.holds.append(hold)
        self._limits()
        engine = self.engine

        async def start() -> None:
            hold.task = asyncio.create_task(_hold(engine, hold))

        self.loops[loop].call(start, "starting a hold")

    def _release(self, hold: HoldRec) -> None:
        self.holds.remove(hold)
        if self.phase == "alive":
            self._limits()
        self.loops[hold.loop].loop.call_soon_threadsafe(hold.ops.put_nowait, None)
        wait_event(hold.done, f"hold {hold.hid}'s block ending")
        assert hold.error is None and not hold.cancelled, (hold.error, hold.cancelled)

    @precondition(lambda self: self._active())
    @rule(pick=PICK)
    def release(self, pick: int) -> None:
        hold = self._pick(self._active(), pick)
        note(f"hold {hold.hid}: release")
        self._release(hold)

    @precondition(lambda self: self._active())
    @rule(pick=PICK)
    def release_again(self, pick: int) -> None:
        """The same as ``release``: a second rule, so that holds do not pile up."""
        self.release(pick)

    def _pending_holds(self) -> list[HoldRec]:
        return [h for h in self.holds if h.state == "pending" and h.expect_error is None]

    @precondition(lambda self: self._pending_holds())
    @rule(pick=PICK)
    def cancel_hold(self, pick: int) -> None:
        """Cancel a task waiting to enter ``paused(at_step=k)``: the hold is withdrawn."""
        hold = self._pick(self._pending_holds(), pick)
        note(f"hold {hold.hid}: cancel while waiting for step {hold.at_step}")
        self.holds.remove(hold)
        self._limits()
        task = hold.task
        assert task is not None
        self.loops[hold.loop].loop.call_soon_threadsafe(task.cancel)
        del task
        wait_event(hold.done, f"hold {hold.hid}'s cancelled task ending")
        assert hold.cancelled and not hold.entered.is_set(), (hold.error, hold.entered_step)

    @precondition(lambda self: self.phase == "alive" and self._active())
    @rule(
        pick=PICK,
        op=st.sampled_from(["wait", "ahead", "nested", "generate", "keep", "resume"]),
        spawn=st.booleans(),
        clear=st.booleans(),
    )
    def in_hold(self, pick: int, op: str, spawn: bool, clear: bool) -> None:
        """A call from inside a task's own ``paused()`` block (or a task it created there)."""
        hold = self._pick(self._active(), pick)
        if "held_wait" in AVOID and (op == "ahead" or (op == "wait" and self._running())):
            op = "nested"
        note(f"hold {hold.hid}: {op} from inside the block{' (in a new task)' if spawn else ''}")
        engine = self.engine
        error: type[BaseException] | None = None
        req: Req | None = None
        factory: Callable[[], Coroutine[Any, Any, Any]]
        if op == "wait":
            expected = self._pause("wait", clear, own=True)
            error = EngineHeldError if expected == "held" else None

            async def factory() -> Any:
                await engine.pause_generation(mode="wait", clear_cache=clear)

        elif op == "ahead":
            error = EngineHeldError
            step = self.steps + 1

            async def factory() -> Any:
                return await _enter(engine, step)

        elif op == "nested":

            async def factory() -> Any:
                return await _enter(engine, None)

        elif op == "generate":
            req = made = self._new(hold.loop, 1, "cumulative", 2)
            params, rid = self._params(req), req.rid

            async def factory() -> Any:
                made.stream = engine.generate("prompt", params, request_id=rid)

        elif op == "keep":
            self._pause("keep", clear, own=True)

            async def factory() -> Any:
                await engine.pause_generation(mode="keep", clear_cache=clear)

        else:
            self._resume()

            async def factory() -> Any:
                await engine.resume_generation()

        if spawn:
            inner = factory

            async def factory() -> Any:
                return await asyncio.create_task(inner())

        done: concurrent.futures.Future[Result] = concurrent.futures.Future()
        self.loops[hold.loop].loop.call_soon_threadsafe(hold.ops.put_nowait, (factory, done))
        result = wait(done, f"{op} inside hold {hold.hid}")
        self._expect(result, f"{op} inside hold {hold.hid}", error)
        if op == "nested":
            assert result.value == self.steps, (result.value, self.steps)

    # -- steps -----------------------------------------------------------------------

    @precondition(lambda self: self.phase == "alive" and self._can_step())
    @rule(count=st.integers(1, 4), first=LOOP, drain=LOOP)
    def advance(self, count: int, first: int, drain: int) -> None:
        """Let the engine core produce up to ``count`` outputs, one at a time.

        After each step both loops answer (``first`` first), so that streams react
        to the step's outputs before the next; ``drain`` takes back an unused credit.
        """
        fake = self.fake
        for _ in range(count):
            if not self._can_step():
                return
            productive, idle = fake.productive, fake.idle
            fake.credit()
            with fake.cond:
                stepped = fake.cond.wait_for(
                    lambda p=productive, i=idle: fake.productive > p or fake.idle > i,  # type: ignore[misc]
                    BOUND,
                )
            if not stepped:
                raise Hang(f"hang: no step within {BOUND} s of a credit, with requests in flight")
            for _ in range(fake.idle - idle):
                self._on_step(productive=False)
            if fake.productive > productive:
                note(f"step {self.steps + 1}")
                self._on_step(productive=True)
            # Streams that react to this step's outputs (a break) do so before both answer.
            for i in (first, 1 - first):
                self._noop(i)
            if fake.productive == productive:
                leftover = self._run(
                    drain, lambda: self.engine.run_on_engine(_drain), "drain", False
                )
                assert leftover.value == 1, leftover

    @precondition(lambda self: self.phase == "alive" and self._can_step())
    @rule(count=st.integers(1, 4), first=LOOP, drain=LOOP)
    def advance_more(self, count: int, first: int, drain: int) -> None:
        """The same as ``advance``: more rules, so that steps are drawn more often."""
        self.advance(count, first, drain)

    @precondition(lambda self: self.phase == "alive" and self._can_step())
    @rule(count=st.integers(1, 4), first=LOOP, drain=LOOP)
    def advance_further(self, count: int, first: int, drain: int) -> None:
        """The same as ``advance``: more rules, so that steps are drawn more often."""
        self.advance(count, first, drain)

    @precondition(lambda self: self.phase == "alive" and self._running() and not self._can_step())
    @rule()
    def no_step(self) -> None:
        """A core output while a hold or a "keep" pause stops the stepping: no step runs."""
        fake = self.fake
        before = fake.steps
        fake.credit()
        for i in (0, 1):
            self._noop(i)
        drained = self._run(0, lambda: self.engine.run_on_engine(_drain), "drain", False)
        assert fake.steps == before, f"{fake.steps - before} steps ran: {fake.violations}"
        assert drained.value == 1, drained

    # -- the ends --------------------------------------------------------------------

    def _may_end(self) -> bool:
        # Ending is one rule of many, and only once the lifetime has had time to build a state.
        return self.phase == "alive" and self.age >= MIN_AGE

    @precondition(lambda self: self._may_end())
    @rule(how=st.sampled_from(["close", "step", "core", "process"]), loop=LOOP)
    def end(self, how: str, loop: int) -> None:
        """Close the engine, or kill it: a step raises, the core dies, its process dies."""
        if how == "step" and not self._can_step():
            how = "core"
        if how == "process" and self.process is None:
            how = "core"
        if how != "close" and self.policy is not None:
            self._kill(how, loop, gated=False)
        elif how == "close":
            result = self._run(loop, lambda: self.engine.aclose(), "aclose", record=False)
            self._expect(result, "aclose", None)
            self._closed()
        elif how == "step":
            self.fake.fail_with = RuntimeError(f"boom at step {self.steps + 1}")
            self.fake.credit()
            wait_event(self.fake.shut_down, "the engine stopping after step() raised")
            self._die(f"RuntimeError: boom at step {self.steps + 1}")
        elif how == "core":

            def dead(_: object) -> None:
                raise VllmEngineDeadError()

            # A call into the engine core finds it dead (vLLM's EngineDeadError).
            result = self._run(loop, lambda: self.engine.run_on_engine(dead), "run_on_engine")
            self._die("EngineDeadError: EngineCore encountered an issue")
            self._expect(result, "run_on_engine into a dead core", EngineDeadError)
            wait_event(self.fake.shut_down, "the engine stopping after the core died")
        else:
            # The engine-core process is killed: the watchdog declares the engine dead.
            assert self.process is not None
            self.process.kill()
            wait_event(self.fake.shut_down, "the engine stopping after its core process died")
            assert self.engine.errored
            self._die("ChildProcessError: engine process FakeEngineCore")

    @precondition(lambda self: self._killable())
    @rule(how=st.sampled_from(["step", "step", "core", "process"]), loop=LOOP, gated=st.booleans())
    def kill(self, how: str, loop: int, gated: bool) -> None:
        """Under a RestartPolicy, with tokens made in the engine: kill it; it restarts, or dies.

        (``end`` kills it too, whatever it holds.)
        """
        if how == "step" and not self._can_step():
            how = "core"
        if how == "process" and self.process is None:
            how = "core"
        self._kill(how, loop, gated)

    @precondition(lambda self: self._killable())
    @rule(how=st.sampled_from(["step", "step", "core", "process"]), loop=LOOP, gated=st.booleans())
    def kill_again(self, how: str, loop: int, gated: bool) -> None:
        """The same as ``kill``: a second rule, so that deaths with tokens made come often."""
        self.kill(how, loop, gated)

    def _killable(self) -> bool:
        # With a request in the engine that has made tokens: a death it must survive.
        return (
            self.phase == "alive"
            and self.policy is not None
            and any(r.tokens for r in self._running())
        )

    def _kill(self, how: str, loop: int, gated: bool) -> None:
        assert self.policy is not None
        old, number = self.fake, len(self.deaths) + 1
        beyond = number > self.policy
        cause = {
            "step": f"RuntimeError: boom at step {self.steps + 1}",
            "core": "EngineDeadError: EngineCore encountered an issue",
            "process": "ChildProcessError: engine process FakeEngineCore",
        }[how]
        self.deaths.append(cause)
        gated = gated and not beyond
        note(f"-- engine {self.lifetimes}: death {number} ({how}{', gated' if gated else ''})")
        self.gate = threading.Event() if gated else None
        self.building.clear()
        self.built.clear()
        called: concurrent.futures.Future[Result] | None = None
        if how == "step":
            old.fail_with = RuntimeError(f"boom at step {self.steps + 1}")
            old.credit()
        elif how == "core":

            def dead(engine: object) -> str:
                if engine is old:
                    raise VllmEngineDeadError()
                return "applied again"

            # A call into the engine core finds it dead; it is applied again on the new one.
            called = self._submit(loop, lambda: self.engine.run_on_engine(dead))
        else:
            assert self.process is not None
            self.process.kill()
        event(f"death {'beyond the policy' if beyond else 'restarted'}: {how}")
        if gated:
            event("death: a gated rebuild")
        if beyond:
            wait_event(old.shut_down, "the engine stopping after its last death")
            self._die("\n".join([f"died {number} times", *self.deaths]))
            if called is not None:
                self._expect(wait(called, "run_on_engine into a dead core"), "it", EngineDeadError)
            assert self.engine.errored
            return
        wait_event(self.building, "the rebuild starting")
        wait_event(old.shut_down, "the dead engine's shutdown")
        assert not old.violations, old.violations
        waiting: concurrent.futures.Future[Result] | None = None
        if self.gate is not None:
            # Degraded, not dead: check_health says so; a call issued now waits in the inbox.
            assert self.engine.restarting
            health = self._run(loop, self.engine.check_health, "check_health", False)
            self._expect(health, "check_health while restarting", EngineRestartingError)
            assert cause in str(health.error), (health.error, cause)
            waiting = self._submit(1 - loop, lambda: self.engine.run_on_engine(_itself))
            assert not waiting.done(), "a call was answered while the engine was rebuilt"
            self.gate.set()
        wait_event(self.built, "the new engine being built")
        self._restarted()
        if called is not None:
            result = wait(called, "run_on_engine applied again on the new engine")
            self._expect(result, "run_on_engine into a dead core", None)
            assert result.value == "applied again", result
        if waiting is not None:
            result = wait(waiting, "the call issued during the rebuild")
            self._expect(result, "run_on_engine during the rebuild", None)
            assert result.value is self.fake, "the call issued meanwhile ran on the old engine"
        health = self._run(loop, self.engine.check_health, "check_health", False)
        self._expect(health, "check_health after the restart", None)

    @precondition(lambda self: self.phase == "alive")
    @rule(loop=LOOP, gated=st.booleans())
    def planned_restart(self, loop: int, gated: bool) -> None:
        """``engine.restart()``: a new engine, every request resumed on it, no death counted.

        Without a policy it raises ``ValueError`` at once and changes nothing.
        Gated, the rebuild waits for the test: meanwhile ``check_health()``
        raises ``EngineRestartingError`` and a call issued then waits.
        """
        if self.policy is None:
            result = self._run(loop, self.engine.restart, "restart()")
            self._expect(result, "restart() without a RestartPolicy", ValueError)
            return
        old = self.fake
        self.planned += 1
        note(f"-- engine {self.lifetimes}: restart() on loop {loop}{' (gated)' if gated else ''}")
        event(f"planned restart{': gated' if gated else ''}")
        self.gate = threading.Event() if gated else None
        self.building.clear()
        self.built.clear()
        restart = self._submit(loop, self.engine.restart)
        wait_event(self.building, "the planned rebuild starting")
        wait_event(old.shut_down, "the old engine's shutdown")
        assert not old.violations, old.violations
        waiting: concurrent.futures.Future[Result] | None = None
        if self.gate is not None:
            assert self.engine.restarting
            health = self._run(loop, self.engine.check_health, "check_health", False)
            self._expect(health, "check_health during restart()", EngineRestartingError)
            waiting = self._submit(1 - loop, lambda: self.engine.run_on_engine(_itself))
            assert not waiting.done(), "a call was answered while the engine was rebuilt"
            self.gate.set()
        wait_event(self.built, "the new engine being built")
        self._restarted()
        self._expect(wait(restart, "restart()"), "restart()", None)
        if waiting is not None:
            result = wait(waiting, "the call issued during the rebuild")
            self._expect(result, "run_on_engine during the rebuild", None)
            assert result.value is self.fake, "the call issued meanwhile ran on the old engine"
        health = self._run(loop, self.engine.check_health, "check_health", False)
        self._expect(health, "check_health after restart()", None)

    def _restarted(self) -> None:
        """The new engine is in: the model's requests resume on it, and it takes one credit."""
        fake, proc = self.rebuilt[-1]
        lo, hi = self.resets  # counted on the dead engine so far; the rest come on the new one
        done = self.fake.resets
        self.resets = (max(0, lo - done), max(0, hi - done))
        self.fake, self.process, self.steps_base = fake, proc, self.steps
        for req in self._running():
            if req.kind is RequestOutputKind.FINAL_ONLY or req.tokens == 0:
                req.tokens = 0  # its stream was sent nothing: it runs again from its prompt
        self._limits()
        note(f"-- engine {self.lifetimes}: restarted ({len(self.deaths)})")
        resumed = [r for r in self._running() if r.tokens]
        event(f"restart: {'resumed' if resumed else 'no request sent tokens'}")
        # The first credit once the worker hooks the new core's outputs: the hook fires.
        wait_event(fake.outputs_queue.watched, "the worker hooking the new core's outputs")
        fake.credit()
        if self._can_step():
            with fake.cond:
                stepped = fake.cond.wait_for(lambda: fake.productive > 0, BOUND)
            if not stepped:
                raise Hang(f"hang: no step on the new engine within {BOUND} s of a credit")
            note(f"step {self.steps + 1} (the new engine's first)")
            self._on_step(productive=True)
            for i in (0, 1):
                self._noop(i)
        else:
            drained = self._run(0, lambda: self.engine.run_on_engine(_drain), "drain", False)
            assert drained.value == 1, drained

    @precondition(lambda self: self.phase in ("dead", "closed"))
    @rule(
        loop=LOOP,
        call=st.sampled_from(["generate", "abort", "pause", "resume", "reset", "call", "hold"]),
    )
    def later_call(self, loop: int, call: str) -> None:
        """Every call after a death or a close raises its error at once."""
        engine = self.engine
        calls: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
            "generate": lambda: _generate_now(engine),
            "abort": lambda: engine.abort("r1"),
            "pause": lambda: engine.pause_generation(mode="wait"),
            "resume": engine.resume_generation,
            "reset": engine.reset_prefix_cache,
            "call": lambda: engine.run_on_engine(_noop),
            "hold": lambda: _enter(engine, None),
        }
        result = self._run(loop, calls[call], f"{call} after the end")
        self._expect(result, f"{call} after the end", self._gone())

    @precondition(lambda self: self.phase in ("dead", "closed"))
    @rule(process=st.booleans(), restarts=RESTARTS)
    def restart(self, process: bool, restarts: int | None) -> None:
        """A fresh engine for a new lifetime."""
        self._finish()
        self._start(process, restarts)

    # -- the invariant ---------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.phase == "none":
            return
        self.age += 1
        if self.phase == "alive":
            for i in (0, 1):
                self._noop(i)
            self._check_engine()
        self._settle()
        for i, answers in enumerate(self.answers):
            assert answers == sorted(answers), (
                f"loop {i}'s commands answered out of order: {answers}"
            )
            self.answers[i] = answers[-1:]
        applied = self.fake.applied[self.applied_seen :]
        for i in (0, 1):
            mine = [seq for loop, seq in applied if loop == i]
            assert mine == sorted(mine), f"loop {i}'s calls applied out of order: {mine}"
        self.applied_seen = len(self.fake.applied)

    def _check_engine(self) -> None:
        snapshot = self._run(0, lambda: self.engine.run_on_engine(_unfinished), "snapshot", False)
        self._expect(snapshot, "snapshot", None)
        expected = {r.rid: r.tokens for r in self._running()}
        held = held_tokens(snapshot.value)
        assert {rid: _one(counts) for rid, counts in held.items()} == expected, (
            f"the engine holds {snapshot.value}, the model says {expected}"
        )
        assert not self.fake.violations, self.fake.violations
        assert self.engine.step_count == self.steps, (self.engine.step_count, self.steps)
        assert self.fake.steps == self.steps - self.steps_base, (
            self.fake.steps,
            self.steps,
            self.steps_base,
        )
        stats = self.engine.stats()
        assert stats.restarts == len(self.deaths) + self.planned, (stats, self.deaths)
        parked = sum(r.state == "parked" for r in self.reqs.values())
        assert stats.requests_in_flight == len(expected), (stats, expected)
        assert stats.requests_waiting == parked, (stats, parked)
        assert stats.paused == (self.paused or bool(self._active())), (stats, self.paused)
        assert stats.steps == self.steps, stats
        extra = self.parked_aborts
        assert self.finished <= stats.requests_finished <= self.finished + extra, (
            stats,
            self.finished,
            extra,
        )
        assert self.aborted <= stats.requests_aborted <= self.aborted + extra, (
            stats,
            self.aborted,
            extra,
        )
        paused = self._run(0, self.engine.is_paused, "is_paused", False)
        assert paused.value is self.paused, (paused, self.paused)
        lo, hi = self.resets
        assert lo <= self.fake.resets <= hi, (
            f"{self.fake.resets} prefix-cache resets, the model says {lo} to {hi}"
        )
        if lo == hi:
            return
        self.resets = (self.fake.resets, self.fake.resets)

    def _settle(self) -> None:
        """Everything due has completed, as predicted; everything else still waits."""
        self._settle_consumers()
        for hold in list(self.holds):
            if hold.expect_error is not None:
                wait_event(hold.done, f"hold {hold.hid} failing")
                assert isinstance(hold.error, hold.expect_error), (hold.hid, hold.error)
                self.holds.remove(hold)
            elif hold.state == "active":
                wait_event(hold.entered, f"hold {hold.hid} entering at step {hold.expect_step}")
                assert hold.error is None, hold.error
                assert hold.entered_step == hold.expect_step, (hold.entered_step, hold.expect_step)
            else:
                assert not hold.done.is_set() and not hold.entered.is_set(), (
                    f"hold {hold.hid} for step {hold.at_step} ended or entered at step "
                    f"{self.steps}: {hold.error!r}"
                )
        for w in list(self.waits):
            if w.due:
                wait_event(w.done, "a wait pause returning")
                assert w.result is not None
                self._expect(w.result, "pause_generation(wait)", w.expect_error)
                self.waits.remove(w)
            else:
                assert not w.done.is_set(), f"a wait pause returned early: {w.result}"


# -- coroutines run on the loops ---------------------------------------------------


def _noop(_: object) -> None:
    return None


def _one(counts: set[int]) -> int | set[int]:
    """The one count all completions of a request have (else all of them, to fail on)."""
    return next(iter(counts)) if len(counts) == 1 else counts


def _itself(engine: object) -> object:
    return engine


def _drain(engine: Any) -> int:
    drained: int = engine.drain()
    return drained


def _unfinished(engine: Any) -> dict[str, int]:
    unfinished: dict[str, int] = engine.unfinished()
    return unfinished


async def _generate_now(engine: AsyncEngine) -> RequestStream:
    return engine.generate("prompt", SamplingParams(max_tokens=1))


async def _enter(engine: AsyncEngine, at_step: int | None) -> int:
    async with engine.paused(at_step=at_step) as step:
        return step


def _holders(obj: object) -> list[str]:
    """Describe what refers to ``obj`` (and what refers to those), for a test-bug message."""
    described = []
    for holder in gc.get_referrers(obj):
        if isinstance(holder, list) and holder and holder[0] is obj:
            continue  # gc's own list
        above = [type(h).__name__ for h in gc.get_referrers(holder)][:5]
        described.append(f"{type(holder).__name__} {str(holder)[:200]} <- {above}")
    return described


async def _hold(engine: AsyncEngine, hold: HoldRec) -> None:
    """Hold the engine until told to release; run the ops sent meanwhile inside the block."""
    try:
        async with engine.paused(at_step=hold.at_step) as step:
            hold.entered_step = step
            hold.entered.set()
            while (op := await hold.ops.get()) is not None:
                factory, done = op
                try:
                    result = Result(await factory())
                except Exception as exc:
                    result = Result(error=exc)
                if not done.cancelled():  # cancelled: the test gave up waiting (a hang)
                    done.set_result(result)
                del op, factory, done, result
    except asyncio.CancelledError:
        hold.cancelled = True
    except Exception as exc:
        hold.error = exc
    finally:
        hold.done.set()


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_engine_agrees_with_the_model() -> None:
    """Random interleavings from two loops keep the engine in agreement with the model."""
    run_state_machine_as_test(EngineMachine, settings=settings())
