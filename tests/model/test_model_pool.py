"""A pool of two engines against a model: drains, readmits, rolling and planned restarts.

A hypothesis ``RuleBasedStateMachine`` drives ``AsyncEnginePool`` over two
``AsyncEngine(CreditEngine())`` members (tests/model/model_support.py: fake
engines that step once per credit the test gives), from two event loops on
two threads, and keeps a model of where every request is and what its
stream must show. Rules: generate (n 1 and 2; DELTA, CUMULATIVE,
FINAL_ONLY; short and endless), await, iterate or ``anext`` a stream, cancel
its task, ``aclose()`` it, ``pool.abort()`` of known and unknown ids, steps
of either member, ``pause_generation`` ("abort" and "keep") and
``resume_generation``, a member held by ``paused()`` in a task and released
by a later rule, and the operations of issue 32: ``pool.drain(i)`` with and
without ``handoff`` (one that must wait stays pending across rules, until
the member has nothing in flight), ``pool.readmit(i)``, ``pool.rolling(fn)``
with ``fn`` a planned ``engine.restart()``, and ``engine.restart()`` on one
member (gated: the rebuild waits for the test, and meanwhile
``check_health()`` raises ``EngineRestartingError`` and the pool routes new
requests to the other member). Then the ends: a member's core dies (a call
into it raises vLLM's ``EngineDeadError``), and ``pool.aclose()``, after
which a fresh pool starts, so one example covers several lifetimes.

Each lifetime's members have a ``RestartPolicy``: ``max_restarts=0`` (every
death final; planned restarts and hand-overs still work) or 1 (the first
death of a member hands its requests to the other member, if it is live and
not drained, as failover does, and the member is rebuilt; the second is
final).

What the model predicts: a hand-over (drain, roll, failover) moves every
admitted request of the member to the other one, where it continues from
its last token (a FINAL_ONLY request, or one sent nothing, runs again from
its prompt); requests parked by a pause stay where they are; a planned
restart resumes the member's requests on its new engine, counted by
``stats().restarts`` but not as a death; a drain returns, once the member
holds nothing, a ``Drained`` record of what moved and what stayed (an
empty one if the pool was closed meanwhile); ``pool.drained`` is the
members drained and not readmitted; a member drained takes no new request,
and with every live member drained ``generate`` raises
``EngineClosedError(draining=True)``.

The invariants, checked after every rule, are the single-engine machine's
(test_model_fake.py): every stream ends exactly once, with the tokens the
fakes produced or the documented error; each member's engine holds exactly
the requests the model puts there, so nothing is left that no stream owns;
``stats()`` agrees; no step runs while a hold or a "keep" pause forbids it;
every wait is bounded (``ASYNCKV_MODEL_BOUND``, 10 s): a call that takes
longer is a hang, and fails.

Hypothesis runs a quarter of the profile's examples (``max_examples``) here:
two engines per example cost twice the single-engine machine's, and its
rules already cover what a member does alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
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
    AsyncEnginePool,
    Drained,
    EngineClosedError,
    EngineDeadError,
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
    Hang,
    LoopThread,
    Req,
    Result,
    StreamRules,
    feed,
    held_tokens,
    wait,
    wait_event,
)

LONG = 10**6  # tokens: a request that never finishes by itself
MEMBER = st.integers(0, 1)
MIN_AGE = 12  # rules in a lifetime before it may end
DEATH = "EngineDeadError: EngineCore encountered an issue"
CONSUMERS: list[ConsumerKind] = ["await", "iterate", "anext"]


@dataclass(eq=False)
class Member:
    """One member as the model sees it: its engine, its fake, its steps and restarts."""

    index: int
    fake: CreditEngine
    engine: AsyncEngine
    phase: Literal["alive", "dead"] = "alive"
    steps: int = 0
    steps_base: int = 0  # the member's step count when this fake came in
    restarts: int = 0  # planned restarts and deaths it was rebuilt after
    deaths: int = 0
    held: Held | None = None
    rebuilt: list[CreditEngine] = field(default_factory=list)
    building: threading.Event = field(default_factory=threading.Event)
    built: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event | None = None


@dataclass(eq=False)
class Held:
    """A task holding one member's ``paused()`` until a later rule releases it."""

    member: int
    loop: int
    entered: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    release: asyncio.Future[None] | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class DrainRec:
    """A ``pool.drain`` that waits for its member to hold nothing."""

    member: int
    moved: frozenset[str]
    stayed: frozenset[str]
    future: concurrent.futures.Future[Result]
    due: bool = False
    empty: bool = False  # the pool was closed first: the record is empty


class PoolMachine(StreamRules):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.loops = [LoopThread("pool-loop-0"), LoopThread("pool-loop-1")]
        self.phase: Literal["none", "alive", "closed"] = "none"
        self.ids = 0
        self.lifetimes = 0

    # -- lifetimes -----------------------------------------------------------------

    @initialize(restarts=st.sampled_from([0, 0, 1]))
    def start(self, restarts: int) -> None:
        self._start(restarts)

    def _start(self, restarts: int) -> None:
        self.policy = restarts
        self.members: list[Member] = []
        for i in (0, 1):
            fake = CreditEngine()
            engine = AsyncEngine(
                fake,
                freeze_gc=False,
                rebuild=functools.partial(self._rebuild, i),
                restart=RestartPolicy(max_restarts=restarts, window=3600.0),
            )
            self.members.append(Member(i, fake, engine))
        self.pool = AsyncEnginePool(m.engine for m in self.members)
        self.lifetimes += 1
        note(f"-- pool {self.lifetimes} (max_restarts={restarts})")
        self.phase = "alive"
        self.age = 0
        self.paused = False
        self.frozen = False
        self.drained: set[int] = set()
        self.drains: list[DrainRec] = []
        self.reqs: dict[str, Req] = {}
        self.where: dict[str, int] = {}  # request id -> the member that holds it
        self._run(0, self.pool.start, "pool.start()")
        for member in self.members:
            self._prime(member)

    def _prime(self, member: Member) -> None:
        """Show the worker its output hook works: one credit with nothing to step, taken back."""
        fake = member.fake
        wait_event(fake.outputs_queue.watched, "the worker hooking the core's outputs")
        fake.credit()
        drained = self._run(0, lambda: member.engine.run_on_engine(_drain), "drain")
        assert drained.value == 1, drained

    def _rebuild(self, index: int) -> CreditEngine:
        """A member's ``rebuild`` (on its worker thread)."""
        member = self.members[index]
        member.building.set()
        gate = member.gate
        if gate is not None and not gate.wait(BOUND):
            raise Hang("hang: the gated rebuild was never released")
        fake = CreditEngine(primed=False)
        member.rebuilt.append(fake)
        member.built.set()
        return fake

    def _finish(self) -> None:
        """End this lifetime: close, then check that everything ended as the model says."""
        if self.phase == "alive":
            self._close(0)
        self._settle()
        for member in self.members:
            if member.held is not None:
                self._release(member)
        for req in self.reqs.values():
            if req.stream is not None and not req.consumed_end and not req.closed:
                self._start_consumer(req, "await")
        self._settle()
        for member in self.members:
            wait_event(member.fake.shut_down, f"member {member.index}'s shutdown")
            assert not member.fake.violations, member.fake.violations
        for req in self.reqs.values():
            req.stream = None

    def teardown(self) -> None:
        try:
            if self.phase != "none":
                self._finish()
        finally:
            stopped = [loop.stop() for loop in self.loops]
        assert all(stopped), "an event loop could not be stopped"

    # -- helpers -------------------------------------------------------------------

    def _run(self, loop: int, factory: Callable[[], Coroutine[Any, Any, Any]], what: str) -> Result:
        """Run a call on ``loop``, bounded."""
        return wait(self._submit(loop, factory), f"{what} on loop {loop}")

    def _submit(
        self, loop: int, factory: Callable[[], Coroutine[Any, Any, Any]]
    ) -> concurrent.futures.Future[Result]:
        async def go() -> Result:
            try:
                return Result(value=await factory())
            except Exception as exc:
                return Result(error=exc)

        return self.loops[loop].submit(go())

    def _barrier(self, member: Member) -> None:
        """Both loops have every answer the member sent before now."""
        if member.phase != "alive":
            return
        for loop in (0, 1):
            result = self._run(loop, lambda: member.engine.run_on_engine(_noop), "barrier")
            assert result.error is None, result.error

    def _expect(self, result: Result, what: str, error: type[BaseException] | None) -> None:
        if error is None:
            assert result.error is None, f"{what} raised {result.error!r}"
        else:
            assert isinstance(result.error, error), (
                f"{what}: expected {error.__name__}, got {result.error!r} / {result.value!r}"
            )

    def _on(self, index: int, *states: str) -> list[Req]:
        return [
            r for r in self.reqs.values() if self.where.get(r.rid) == index and r.state in states
        ]

    def _live(self) -> list[Member]:
        return [m for m in self.members if m.phase == "alive"]

    def _routable(self) -> list[Member]:
        return [m for m in self._live() if m.index not in self.drained]

    def _can_step(self, member: Member) -> bool:
        return (
            member.phase == "alive"
            and bool(self._on(member.index, "running"))
            and not self.frozen
            and member.held is None
        )

    def _limits(self) -> None:
        """Tell each fake whether the model says no step may start now."""
        for member in self._live():
            if member.held is not None:
                member.fake.forbidden = "a paused() block holds the member"
            elif self.frozen:
                member.fake.forbidden = 'a "keep" pause freezes the requests'
            else:
                member.fake.forbidden = None

    # -- model transitions -----------------------------------------------------------

    def _abort(self, req: Req) -> None:
        if req.state in ("running", "parked"):
            req.end_tokens = req.tokens if req.state == "running" else 0
            req.state, req.outcome, req.unread = "ended", "abort", True
            note(f"{req.rid}: aborted at {req.end_tokens} tokens")
            feed(req)
        self._drains_due()

    def _drains_due(self) -> None:
        for drain in self.drains:
            if not drain.due and not self._on(drain.member, "running", "parked"):
                drain.due = True

    def _move(self, reqs: list[Req], to: int) -> None:
        """Requests handed to member ``to``: each continues there from its last token."""
        for req in reqs:
            self.where[req.rid] = to
            self._resumed(req)
        if reqs:
            note(f"moved to member {to}: {[r.rid for r in reqs]}")

    def _resumed(self, req: Req) -> None:
        if req.kind is RequestOutputKind.FINAL_ONLY or req.tokens == 0:
            req.tokens = 0  # its stream was sent nothing: it runs again from its prompt

    def _on_step(self, member: Member, productive: bool) -> None:
        member.steps += 1
        if productive:
            for req in self._on(member.index, "running"):
                req.tokens += 1
                if req.streaming:
                    req.unread = True
                if req.tokens >= req.max_tokens:
                    req.state, req.outcome, req.unread = "ended", "length", True
                    req.end_tokens = req.tokens
                feed(req)
        self._drains_due()

    def _end(self, reqs: list[Req], outcome: str, cause: str = "") -> None:
        for req in reqs:
            req.state, req.outcome, req.unread = "ended", outcome, True
            req.cause, req.end_tokens = cause, req.tokens
            feed(req)

    def _rebuilt(self, member: Member, loop: int) -> None:
        """The member's new engine is in: its requests resume there; it takes one credit."""
        fake = member.rebuilt[-1]
        member.fake, member.steps_base = fake, member.steps
        member.restarts += 1
        for req in self._on(member.index, "running"):
            self._resumed(req)
        self._limits()
        wait_event(fake.outputs_queue.watched, "the worker hooking the new core's outputs")
        fake.credit()
        if self._can_step(member):
            with fake.cond:
                stepped = fake.cond.wait_for(lambda: fake.productive > 0, BOUND)
            if not stepped:
                raise Hang(f"hang: no step on the new engine within {BOUND} s of a credit")
            note(f"member {member.index}: step {member.steps + 1} (the new engine's first)")
            self._on_step(member, productive=True)
            self._barrier(member)
        else:
            drained = self._run(loop, lambda: member.engine.run_on_engine(_drain), "drain")
            assert drained.value == 1, drained

    # -- requests --------------------------------------------------------------------

    @precondition(lambda self: self.phase == "alive")
    @rule(
        loop=LOOP,
        n=st.sampled_from([1, 2]),
        kind=st.sampled_from(sorted(KINDS)),
        tokens=st.sampled_from([1, 2, 3, LONG]),
    )
    def generate(self, loop: int, n: int, kind: str, tokens: int) -> None:
        """``pool.generate()``: a member that is live and not drained takes it, or it raises."""
        self.ids += 1
        req = Req(f"p{self.ids}", loop, n, KINDS[kind], tokens, "running")
        params = SamplingParams(n=n, max_tokens=tokens, output_kind=req.kind)
        pool = self.pool

        async def go() -> int | None:
            req.stream = pool.generate("prompt", params, request_id=req.rid)
            return pool.engine_of(req.rid)

        result = self._run(loop, go, "generate")
        routable = self._routable()
        if not routable:
            draining = any(m.index in self.drained for m in self._live())
            error = EngineClosedError if draining else EngineDeadError
            self._expect(result, "generate with no member to take it", error)
            if draining:
                assert getattr(result.error, "draining", False), result.error
            return
        self._expect(result, "generate", None)
        index = result.value
        assert index in [m.index for m in routable], (index, self.drained, routable)
        req.state = "parked" if self.paused else "running"
        self.reqs[req.rid] = req
        self.where[req.rid] = index
        note(f"{req.rid}: n={n} {kind} max_tokens={tokens} on member {index} ({req.state})")

    @precondition(lambda self: self.phase == "alive")
    @rule(
        loop=LOOP,
        n=st.sampled_from([1, 2]),
        kind=st.sampled_from(sorted(KINDS)),
        tokens=st.sampled_from([1, 2, 3, LONG]),
    )
    def generate_more(self, loop: int, n: int, kind: str, tokens: int) -> None:
        """The same as ``generate``: a second rule, so that requests come often."""
        self.generate(loop, n, kind, tokens)

    def _aclose(self, loop: int, stream: RequestStream) -> Result:
        return self._run(loop, stream.aclose, "stream.aclose()")

    def _settled(self) -> None:
        self._barrier_all()

    @precondition(lambda self: self._consumable())
    @rule(pick=PICK, how=st.sampled_from(CONSUMERS))
    def consume(self, pick: int, how: ConsumerKind) -> None:
        req = self._pick(self._consumable(), pick)
        note(f"{req.rid}: {how}")
        self._start_consumer(req, how)

    @precondition(lambda self: self.phase == "alive" and self.reqs)
    @rule(loop=LOOP, picks=st.lists(PICK, max_size=3), unknown=st.booleans())
    def abort(self, loop: int, picks: list[int], unknown: bool) -> None:
        """``pool.abort()`` of known ids (live, parked or ended) and unknown ones."""
        known = list(self.reqs.values())
        ids = [self._pick(known, p).rid for p in picks]
        if unknown or not ids:
            ids.append(f"unknown-{self.ids}")
        note(f"pool.abort({ids}) on loop {loop}")
        result = self._run(loop, lambda: self.pool.abort(ids), "pool.abort")
        self._expect(result, "pool.abort", None)
        for rid in ids:
            if rid in self.reqs:
                self._abort(self.reqs[rid])
        self._barrier_all()

    def _barrier_all(self) -> None:
        for member in self.members:
            self._barrier(member)

    # -- steps, pauses and holds ---------------------------------------------------

    def _steppable(self) -> list[Member]:
        return [m for m in self.members if self._can_step(m)]

    @precondition(lambda self: self.phase == "alive" and self._steppable())
    @rule(pick=MEMBER, count=st.integers(1, 4))
    def advance(self, pick: int, count: int) -> None:
        """Let one member's core produce up to ``count`` outputs, one at a time."""
        member = self._pick(self._steppable(), pick)
        fake = member.fake
        for _ in range(count):
            if not self._can_step(member):
                return
            productive, idle = fake.productive, fake.idle
            fake.credit()
            with fake.cond:
                stepped = fake.cond.wait_for(
                    lambda p=productive, i=idle: fake.productive > p or fake.idle > i,
                    BOUND,
                )
            if not stepped:
                raise Hang(f"hang: no step within {BOUND} s of a credit, with requests in flight")
            for _ in range(fake.idle - idle):
                self._on_step(member, productive=False)
            if fake.productive > productive:
                note(f"member {member.index}: step {member.steps + 1}")
                self._on_step(member, productive=True)
            self._barrier(member)
            if fake.productive == productive:
                leftover = self._run(0, lambda: member.engine.run_on_engine(_drain), "drain")
                assert leftover.value == 1, leftover

    @precondition(lambda self: self.phase == "alive" and self._steppable())
    @rule(pick=MEMBER, count=st.integers(1, 4))
    def advance_more(self, pick: int, count: int) -> None:
        """The same as ``advance``: a second rule, so that steps are drawn more often."""
        self.advance(pick, count)

    @precondition(lambda self: self.phase == "alive" and not self.paused and self._live())
    @rule(loop=LOOP, mode=st.sampled_from(["abort", "keep", "keep"]))
    def pause(self, loop: int, mode: str) -> None:
        """``pool.pause_generation(mode)`` on every live member: new requests park."""
        note(f"pool.pause_generation(mode={mode!r}) on loop {loop}")
        result = self._run(
            loop,
            lambda: self.pool.pause_generation(mode=mode, clear_cache=False),  # type: ignore[arg-type]
            "pause_generation",
        )
        self._expect(result, f"pause_generation({mode})", None)
        self.paused, self.frozen = True, mode == "keep"
        if mode == "abort":
            for member in self._live():
                for req in self._on(member.index, "running"):
                    self._abort(req)
        self._limits()
        self._barrier_all()

    @precondition(lambda self: self.phase == "alive" and self.paused and self._live())
    @rule(loop=LOOP)
    def resume(self, loop: int) -> None:
        """``pool.resume_generation()``: parked requests run where they were routed."""
        note(f"pool.resume_generation() on loop {loop}")
        result = self._run(loop, self.pool.resume_generation, "resume_generation")
        self._expect(result, "resume_generation", None)
        self.paused, self.frozen = False, False
        for req in self.reqs.values():
            if req.state == "parked":
                req.state = "running"
        self._limits()
        self._barrier_all()

    def _holdable(self) -> list[Member]:
        return [m for m in self._live() if m.held is None]

    @precondition(lambda self: self.phase == "alive" and self._holdable())
    @rule(pick=MEMBER, loop=LOOP)
    def hold(self, pick: int, loop: int) -> None:
        """``async with pool.engines[i].paused():`` in a task, held until a later rule."""
        member = self._pick(self._holdable(), pick)
        held = Held(member.index, loop)
        member.held = held
        note(f"member {member.index}: held by a task on loop {loop}")
        self._limits()
        engine = member.engine

        async def body() -> None:
            try:
                async with engine.paused():
                    held.entered.set()
                    assert held.release is not None
                    await held.release
            except Exception as exc:
                held.error = exc
            finally:
                held.done.set()

        async def start() -> None:
            held.release = asyncio.get_running_loop().create_future()
            asyncio.create_task(body())  # noqa: RUF006  # it ends by the release, held by done

        self.loops[loop].call(start, "starting a hold")
        wait_event(held.entered, f"member {member.index}'s hold entering")

    def _release(self, member: Member) -> None:
        held = member.held
        assert held is not None and held.release is not None
        member.held = None
        self._limits()
        self.loops[held.loop].loop.call_soon_threadsafe(_settle_future, held.release)
        wait_event(held.done, f"member {member.index}'s hold ending")
        assert held.error is None, held.error

    @precondition(lambda self: any(m.held is not None for m in self.members))
    @rule(pick=MEMBER)
    def release(self, pick: int) -> None:
        member = self._pick([m for m in self.members if m.held is not None], pick)
        note(f"member {member.index}: hold released")
        self._release(member)

    # -- drains, readmits, restarts and rolls ------------------------------------------

    def _pending(self, index: int) -> bool:
        return any(d.member == index for d in self.drains)

    @precondition(lambda self: self.phase == "alive")
    @rule(pick=MEMBER, loop=LOOP, handoff=st.booleans())
    def drain(self, pick: int, loop: int, handoff: bool) -> None:
        """``pool.drain(i, handoff=...)``: refused at once, or returns once i holds nothing.

        It drains a member not drained yet, if there is one.
        """
        fresh = [m for m in self.members if m.index not in self.drained]
        member = self._pick(fresh or self.members, pick)
        index, other = member.index, self.members[1 - member.index]
        note(f"pool.drain({index}, handoff={handoff}) on loop {loop}")
        future = self._submit(loop, lambda: self.pool.drain(index, handoff=handoff))
        takes = other.phase == "alive" and other.index not in self.drained
        if index in self.drained or (handoff and not takes):
            self._expect(wait(future, "a refused drain"), "drain", ValueError)
            event("drain: refused")
            return
        self.drained.add(index)
        if member.phase == "dead":
            result = wait(future, "the drain of a dead member")
            self._expect(result, "drain of a dead member", None)
            assert result.value == Drained(index, (), ()), result.value
            return
        running = self._on(index, "running")
        if handoff:
            moved, stayed = frozenset(r.rid for r in running), frozenset[str]()
            self._move(running, other.index)
        else:
            moved, stayed = frozenset(), frozenset(r.rid for r in running)
        # The Vacate, then the Adopts it put in the other member's inbox, are applied.
        self._barrier(member)
        self._barrier(other)
        record = DrainRec(index, moved, stayed, future)
        self.drains.append(record)
        self._drains_due()
        event(f"drain: {'due at once' if record.due else 'waits'} (handoff={handoff})")

    @precondition(lambda self: self.phase == "alive" and self.drained)
    @rule(pick=MEMBER)
    def readmit(self, pick: int) -> None:
        """``pool.readmit(i)`` (from the test's thread: any thread may call it)."""
        index = self._pick(sorted(self.drained), pick)
        note(f"pool.readmit({index})")
        self.pool.readmit(index)
        self.drained.discard(index)

    def _restartable(self) -> list[Member]:
        return [m for m in self._live() if not self._pending(m.index)]

    @precondition(lambda self: self.phase == "alive" and self._restartable())
    @rule(pick=MEMBER, loop=LOOP, gated=st.booleans())
    def planned_restart(self, pick: int, loop: int, gated: bool) -> None:
        """``engine.restart()`` on a member: its requests resume on the new engine; no death.

        Gated, the rebuild waits for the test: meanwhile the member's
        ``check_health()`` raises ``EngineRestartingError`` and a new request
        goes to the other member if it takes requests.
        """
        member = self._pick(self._restartable(), pick)
        old = member.fake
        note(f"member {member.index}: restart() on loop {loop}{' (gated)' if gated else ''}")
        event(f"planned restart{': gated' if gated else ''}")
        member.gate = threading.Event() if gated else None
        member.building.clear()
        member.built.clear()
        restart = self._submit(loop, member.engine.restart)
        wait_event(member.building, "the planned rebuild starting")
        wait_event(old.shut_down, "the old engine's shutdown")
        assert not old.violations, old.violations
        if member.gate is not None:
            assert member.engine.restarting
            health = self._run(loop, member.engine.check_health, "check_health")
            self._expect(health, "check_health during restart()", EngineRestartingError)
            other = self.members[1 - member.index]
            if other.phase == "alive" and other.index not in self.drained:
                self.generate(loop, 1, "cumulative", 2)
                assert self.where[f"p{self.ids}"] == other.index, "routed to a restarting member"
            member.gate.set()
        wait_event(member.built, "the new engine being built")
        self._rebuilt(member, loop)
        self._expect(wait(restart, "restart()"), "restart()", None)

    def _rollable(self) -> bool:
        return (
            self.phase == "alive"
            and len(self._live()) == 2
            and not self.drained
            and not self.drains
            and not any(r.state == "parked" for r in self.reqs.values())
        )

    @precondition(lambda self: self._rollable())
    @rule(loop=LOOP)
    def rolling(self, loop: int) -> None:
        """``pool.rolling(restart)``: each member drained (its requests to the other),
        restarted and readmitted in turn; returns both members' ``Drained`` records."""
        note(f"pool.rolling(restart) on loop {loop}")
        event("rolling restart")
        restarted = [threading.Event(), threading.Event()]
        go_on = [threading.Event(), threading.Event()]

        async def restart(engine: AsyncEngine) -> None:
            index = self.pool.engines.index(engine)
            await engine.restart()
            restarted[index].set()
            # The test primes the new engine's output hook before it takes requests.
            await asyncio.to_thread(go_on[index].wait, BOUND)

        for member in self.members:
            member.gate = None
            member.building.clear()
            member.built.clear()
        future = self._submit(loop, lambda: self.pool.rolling(restart))
        expected: list[Drained] = []
        for member in self.members:
            other = self.members[1 - member.index]
            moving = self._on(member.index, "running")
            expected.append(Drained(member.index, tuple(r.rid for r in moving), ()))
            wait_event(member.built, f"member {member.index} rebuilt by the roll")
            self._move(moving, other.index)
            wait_event(restarted[member.index], f"member {member.index}'s restart() returning")
            self._rebuilt(member, loop)
            go_on[member.index].set()
        result = wait(future, "pool.rolling()")
        self._expect(result, "pool.rolling()", None)
        got = [(d.index, set(d.moved), set(d.stayed)) for d in result.value]
        assert got == [(d.index, set(d.moved), set()) for d in expected], (got, expected)
        self._barrier_all()

    # -- the ends --------------------------------------------------------------------

    def _killable(self) -> list[Member]:
        return [m for m in self._live() if not self._pending(m.index)]

    @precondition(lambda self: self.phase == "alive" and self.age >= 4 and self._killable())
    @rule(pick=MEMBER, loop=LOOP)
    def kill(self, pick: int, loop: int) -> None:
        """A call into a member's core finds it dead: within the policy it is rebuilt (its
        requests first handed to the other member, if that takes requests), else it dies."""
        member = self._pick(self._killable(), pick)
        old = member.fake
        member.deaths += 1
        final = member.deaths > self.policy
        note(f"member {member.index}: its core dies ({'final' if final else 'restarted'})")
        event(f"member death: {'final' if final else 'restarted'}")
        member.gate = None
        member.building.clear()
        member.built.clear()

        def dead(engine: object) -> str:
            if engine is old:
                raise VllmEngineDeadError()
            return "applied again"

        called = self._submit(loop, lambda: member.engine.run_on_engine(dead))
        if final:
            result = wait(called, "run_on_engine into a dead core")
            self._expect(result, "run_on_engine into a dead core", EngineDeadError)
            wait_event(old.shut_down, "the dead member's shutdown")
            member.phase = "dead"
            self._end(self._on(member.index, "running", "parked"), "dead", DEATH)
            self._drains_due()
            return
        other = self.members[1 - member.index]
        wait_event(member.building, "the rebuild starting")
        wait_event(old.shut_down, "the dead member's shutdown")
        if other.phase == "alive" and other.index not in self.drained:
            self._move(self._on(member.index, "running"), other.index)
        wait_event(member.built, "the new engine being built")
        self._rebuilt(member, loop)
        result = wait(called, "run_on_engine applied again on the new engine")
        self._expect(result, "run_on_engine into a dead core", None)
        assert result.value == "applied again", result
        self._barrier(other)

    @precondition(lambda self: self.phase == "alive" and self.age >= MIN_AGE)
    @rule(loop=LOOP)
    def close(self, loop: int) -> None:
        """``pool.aclose()``: every stream ends with ``EngineClosedError``, drains return."""
        self._close(loop)

    def _close(self, loop: int) -> None:
        note(f"-- pool {self.lifetimes} closed")
        result = self._run(loop, self.pool.aclose, "pool.aclose()")
        self._expect(result, "pool.aclose()", None)
        self.phase = "closed"
        self._end([r for r in self.reqs.values() if r.state != "ended"], "closed")
        for drain in self.drains:
            if not drain.due:
                drain.due, drain.empty = True, True

    @precondition(lambda self: self.phase == "closed")
    @rule(loop=LOOP, call=st.sampled_from(["generate", "abort", "drain", "rolling"]))
    def later_call(self, loop: int, call: str) -> None:
        """Every call after the close raises ``EngineClosedError`` at once."""
        pool = self.pool
        calls: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
            "generate": lambda: _generate_now(pool),
            "abort": lambda: pool.abort("p1"),
            "drain": lambda: pool.drain(0),
            "rolling": lambda: pool.rolling(_restart),
        }
        result = self._run(loop, calls[call], f"{call} after the close")
        self._expect(result, f"{call} after the close", EngineClosedError)

    @precondition(lambda self: self.phase == "closed")
    @rule(restarts=st.sampled_from([0, 0, 1]))
    def new_pool(self, restarts: int) -> None:
        """A fresh pool for a new lifetime."""
        self._finish()
        self._start(restarts)

    # -- the invariant ---------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.phase == "none":
            return
        self.age += 1
        if self.phase == "alive":
            self._barrier_all()
            for member in self._live():
                self._check_member(member)
            assert self.pool.drained == frozenset(self.drained), (self.pool.drained, self.drained)
        self._settle()

    def _check_member(self, member: Member) -> None:
        engine, index = member.engine, member.index
        snapshot = self._run(0, lambda: engine.run_on_engine(_unfinished), "snapshot")
        self._expect(snapshot, "snapshot", None)
        expected = {r.rid: r.tokens for r in self._on(index, "running")}
        held = held_tokens(snapshot.value)
        got = {rid: next(iter(c)) if len(c) == 1 else c for rid, c in held.items()}
        assert got == expected, f"member {index} holds {snapshot.value}, the model says {expected}"
        assert not member.fake.violations, member.fake.violations
        assert engine.step_count == member.steps, (index, engine.step_count, member.steps)
        assert member.fake.steps == member.steps - member.steps_base, index
        stats = engine.stats()
        assert stats.restarts == member.restarts, (index, stats, member.restarts)
        assert stats.requests_in_flight == len(expected), (index, stats, expected)
        parked = len(self._on(index, "parked"))
        assert stats.requests_waiting == parked, (index, stats, parked)

    def _settle(self) -> None:
        """Everything due has completed, as predicted; everything else still waits."""
        self._settle_consumers()
        for drain in list(self.drains):
            if drain.due:
                result = wait(drain.future, f"the drain of member {drain.member} returning")
                self._expect(result, f"drain({drain.member})", None)
                record: Drained = result.value
                assert record.index == drain.member, record
                if drain.empty:
                    assert (record.moved, record.stayed) == ((), ()), record
                else:
                    assert (set(record.moved), set(record.stayed)) == (
                        set(drain.moved),
                        set(drain.stayed),
                    ), (record, drain)
                self.drains.remove(drain)
            else:
                assert not drain.future.done(), f"drain({drain.member}) returned early"


# -- what runs on the engines and the loops -------------------------------------------


def _noop(_: object) -> None:
    return None


def _drain(engine: Any) -> int:
    drained: int = engine.drain()
    return drained


def _unfinished(engine: Any) -> dict[str, int]:
    unfinished: dict[str, int] = engine.unfinished()
    return unfinished


def _settle_future(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _generate_now(pool: AsyncEnginePool) -> object:
    return pool.generate("prompt", SamplingParams(max_tokens=1))


async def _restart(engine: AsyncEngine) -> None:
    await engine.restart()


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_pool_agrees_with_the_model() -> None:
    """Drains, readmits, rolls and restarts amid random calls keep the pool in the model's state."""
    profile = settings()
    run_state_machine_as_test(
        PoolMachine, settings=settings(profile, max_examples=max(1, profile.max_examples // 4))
    )
