"""AsyncEnginePool, on the caller's loop: several engines behind one ``generate``/``abort`` API.

A pool is for data parallelism without a shared executor: each ``AsyncEngine``
is a whole model replica (one per GPU, say), with its own worker thread and
prefix cache. The pool only routes: it picks an engine per request and then
gets out of the way, so a stream from the pool is that engine's own stream.

Everything here runs on the caller's thread, usually an event loop (asyncio
or trio; the calls to every engine at once go through ``_gather``). The
routing state (who serves which request, which engine saw which prefix) sits
behind one ``threading.Lock`` held only for bookkeeping and a non-blocking
``engine.generate``, so a pool serves any number of loops, as an engine does.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio

from .._bridge._channel import Reply
from .._errors import EngineClosedError, EngineDeadError
from .._loop._engine import (
    AsyncEngine,
    checked_pause_mode,
    checked_request_id,
    checked_request_ids,
    checked_sampling_params,
)
from .._stats import EngineStats
from .._types import Drained, RestartPolicy
from .._worker._handoff import Vacate
from . import _failover
from ._affinity import PrefixIndex, Router
from ._gather import gather, settle

if TYPE_CHECKING:
    from types import TracebackType

    from vllm import EngineArgs
    from vllm.sampling_params import SamplingParams

    from .._loop._stream import RequestStream
    from .._types import PauseMode

__all__ = ("AsyncEnginePool",)


class AsyncEnginePool:
    """Several ``AsyncEngine``s behind the API of one, routing each request to one of them.

    **Routing.** A request goes to the live engine that served the longest
    prefix of its prompt before, so that engine's prefix cache can hit, unless
    that engine's load exceeds the least-loaded live engine's by more than
    ``affinity_slack``; then, and when no prefix matches, it goes to the
    least-loaded live engine, ties broken round-robin. An engine's load is the
    number of requests the pool has in flight on it, or its own
    ``stats().requests_in_flight + requests_waiting`` if larger (that one also
    counts requests submitted to the engine directly). Prefixes are compared
    in whole blocks: ``block_tokens`` tokens of a ``TokensPrompt``, or
    ``block_chars`` characters of a text prompt (no tokenizing on the loop;
    about four characters make a token). A different LoRA adapter or
    ``cache_salt`` never matches, as in vLLM's cache. The pool remembers the
    latest ``max_prefixes`` blocks, least recently used forgotten first.

    **Failures.** An engine that dies (``engine.errored``) fails its own
    streams with ``EngineDeadError``, as it would alone; the pool sends no new
    request to it and keeps serving from the others. Only when every engine
    is dead do ``generate`` and ``reset_prefix_cache`` raise ``EngineDeadError``.

    With a ``RestartPolicy`` on the engines, a member that dies hands its
    unfinished requests to the least loaded live member, where each resumes
    from its last token (as a restart resumes it; ``pool.abort`` and a
    stream's own abort follow it there), then restarts in the background; it
    takes no new request while it rebuilds, if another can serve, and rejoins
    once it is up. With no live member to take them, they resume on it.

    **Draining and rolling.** ``drain(i)`` stops routing to member ``i``
    and, with ``handoff``, moves its unfinished requests to the live members,
    where each continues from its last token as after a failover;
    ``readmit(i)`` routes to it again; ``rolling(fn)`` does both around
    ``fn(engine)`` for each member in turn (a restart, a weight update), so
    the pool keeps serving throughout.

    The pool owns its engines: ``start()`` starts them all, ``aclose()`` closes
    them all. Build one with ``AsyncEnginePool.from_engine_args([...])`` or
    around engines you made, ``AsyncEnginePool([engine, ...])``. Reset, pause,
    ``stats`` and ``check_health`` apply to every live engine. Step telemetry is
    per engine: ``pool.engines[i].steps()``; ``generate(..., stream_interval=s)``
    passes through to the engine that takes the request.
    """

    def __init__(
        self,
        engines: Iterable[AsyncEngine],
        *,
        affinity_slack: int = 8,
        block_tokens: int = 16,
        block_chars: int = 64,
        max_prefixes: int = 65_536,
    ) -> None:
        self._engines = tuple(engines)
        if not self._engines:
            raise ValueError("a pool needs at least one engine")
        if affinity_slack < 0:
            raise ValueError("affinity_slack must be >= 0")
        self._lock = threading.Lock()
        self._router = Router(
            self._engines, affinity_slack, PrefixIndex(block_tokens, block_chars, max_prefixes)
        )
        self._closed = False
        _failover.install(self._engines, self._lock, self._router)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Iterable[EngineArgs],
        *,
        affinity_slack: int = 8,
        block_tokens: int = 16,
        block_chars: int = 64,
        max_prefixes: int = 65_536,
        freeze_gc: bool = True,
        restart: RestartPolicy | None = None,
    ) -> AsyncEnginePool:
        """Make a pool of one engine per ``EngineArgs``; ``start()`` builds them all.

        Does no heavy work. ``freeze_gc`` and ``restart`` are ``AsyncEngine``'s;
        with ``restart``, a member that dies hands its unfinished requests to a
        live member, where they resume, and restarts in the background (see
        the class). The other keyword arguments are those of ``AsyncEnginePool``.
        """
        return cls(
            [
                AsyncEngine.from_engine_args(args, freeze_gc=freeze_gc, restart=restart)
                for args in engine_args
            ],
            affinity_slack=affinity_slack,
            block_tokens=block_tokens,
            block_chars=block_chars,
            max_prefixes=max_prefixes,
        )

    @property
    def engines(self) -> tuple[AsyncEngine, ...]:
        """The engines, in the order given; ``engine_of`` indexes into this."""
        return self._engines

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Start every engine, concurrently, and wait until all are ready.

        If any engine fails to start, every engine is closed once all have
        settled, and the first failure is raised: nothing is left running.
        A no-op for engines already started.
        """
        self._check_open()
        try:
            results = await settle(engine.start for engine in self._engines)
        except BaseException:
            await self.aclose()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.aclose()
            raise errors[0]

    async def aclose(self, timeout: float = 30.0) -> None:
        """Close every engine, concurrently (see ``AsyncEngine.aclose``). Idempotent.

        Shielded from trio and anyio cancel scopes, as ``AsyncEngine.aclose``.
        """
        self._closed = True
        with anyio.CancelScope(shield=True):
            await gather(functools.partial(engine.aclose, timeout) for engine in self._engines)

    async def __aenter__(self) -> AsyncEnginePool:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError()

    # -- requests ------------------------------------------------------------------

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Route a request to an engine (see the class docstring), submit it, return its stream.

        Everything ``AsyncEngine.generate`` promises holds: the request is in
        that engine's inbox on return, the stream belongs to the running loop,
        and a bad request raises from the stream. ``engine_of(request_id)``
        tells which engine took it.

        Raises:
            ValueError: ``request_id`` is already in flight in the pool, on any
                engine (raised here, unlike a single engine, which raises it
                from the stream, because the pool knows all its ids).
            TypeError: ``sampling_params`` or ``request_id`` has the wrong type.
            EngineDeadError: every engine is dead.
            EngineClosedError, EngineNotStartedError: at once.
        """
        rid = checked_request_id(request_id)
        sampling_params = checked_sampling_params(sampling_params)
        keys = self._router.prefixes.keys(prompt, kwargs)
        with self._lock:
            self._check_open()
            if self._router.owner(rid) is not None:
                raise ValueError(f"request id {rid!r} is already in flight in the pool")
            refused: set[int] = set()
            while True:
                index = self._router.choose(keys, refused)
                if index is None:
                    if any(not self._engines[i].errored for i in self._router.draining):
                        # Every live member is being drained: as a draining engine does.
                        raise EngineClosedError(draining=True)
                    raise self._all_dead()
                try:
                    stream = self._engines[index].generate(prompt, sampling_params, rid, **kwargs)
                except (EngineDeadError, EngineClosedError):
                    # It died (or was closed on its own) since the check: nothing
                    # was submitted, so another engine can take the request.
                    refused.add(index)
                    continue
                break
            self._router.track(index, rid, stream, keys)
        return stream

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests on the engines that serve them; return once all are out.

        As ``AsyncEngine.abort``: each stream ends with a final "abort" output.
        Ids the pool has not in flight (unknown, finished, or submitted to an
        engine directly) are ignored, and so are engines that died meanwhile
        (their streams have already failed).
        """
        ids = checked_request_ids(request_id)
        self._check_open()
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for rid in ids:
                index = self._router.owner(rid)
                if index is not None:
                    by_engine.setdefault(index, []).append(rid)
        await gather(
            functools.partial(self._abort_on, self._engines[i], group)
            for i, group in by_engine.items()
        )

    @staticmethod
    async def _abort_on(engine: AsyncEngine, ids: list[str]) -> None:
        # A dead or closed engine has already ended its streams with that error.
        with contextlib.suppress(EngineDeadError, EngineClosedError):
            await engine.abort(ids)

    def engine_of(self, request_id: str) -> int | None:
        """The index in ``engines`` of the engine serving ``request_id``.

        None unless the request was submitted through the pool and its stream
        has not ended yet.
        """
        with self._lock:
            return self._router.owner(request_id)

    # -- draining and rolling --------------------------------------------------------

    async def drain(
        self, index: int, *, handoff: bool = True, timeout: float | None = None
    ) -> Drained:
        """Stop routing new requests to member ``index`` and wait until it has none in flight.

        The pool routes no new request to the member from the moment this is
        called, until ``readmit(index)``. With ``handoff`` (the default), the
        member's worker, between two of its steps, takes every unfinished
        request out of its engine and hands it to the least loaded live
        member, as a failover does: the request continues there from its
        last token (the same splice; greedy requests get the tokens they
        would have had where the members compute alike), its stream goes on
        with nothing but a pause (``RequestStream.metrics.restarts`` counts
        the move), ``pool.abort`` and the stream's own abort follow it, and
        one whose parameters can't be resumed ends with
        ``RequestNotResumedError``. It continues under the weights of the
        member it moved to. Without ``handoff`` the requests finish where
        they are. Requests queued to the member before the call are handed
        over (or finish) like the others; what no live member can take
        finishes in place.

        Returns, once the member has nothing in flight, a ``Drained`` record
        of what moved and what stayed. The member serves on (requests given
        to it directly are served); only the pool's routing skips it. A dead
        member has nothing in flight: its record is empty.

        If the wait times out or is cancelled, the member is readmitted
        before the error propagates (what moved stays where it went).

        Raises:
            IndexError: no member ``index``.
            ValueError: the member is being drained already; or, with
                ``handoff``, no other live member is there to take the
                requests, or the members have no ``RestartPolicy`` (without
                one requests keep no state to resume from).
            TimeoutError: ``timeout`` seconds passed first.
            EngineClosedError: the pool was closed.
        """
        index = self._checked_index(index)
        self._check_open()
        engine = self._engines[index]
        with self._lock:
            if index in self._router.draining:
                raise ValueError(f"member {index} is being drained already: readmit it first")
            if handoff:
                self._check_handoff(index)
            self._router.draining |= {index}
        try:
            with anyio.fail_after(timeout):
                reply = Reply.here()
                try:
                    engine._submit(Vacate(handoff, reply))
                except (EngineDeadError, EngineClosedError):
                    return Drained(index, (), ())  # ended: its streams ended with it
                try:
                    moved, stayed = await reply.future
                except (EngineDeadError, EngineClosedError):
                    return Drained(index, (), ())
        except BaseException:
            self.readmit(index)
            raise
        return Drained(index, moved, stayed)

    def _check_handoff(self, index: int) -> None:
        # With the pool's lock held: a drain with handoff that could never hand over fails now.
        # index -1 (a roll): every member will be drained.
        drained = self._engines if index < 0 else [self._engines[index]]
        if not all(engine._worker.resumable for engine in drained):
            raise ValueError(
                "handoff needs a RestartPolicy on the members (restart= when they are made): "
                "without one requests keep no state to resume from; drain with handoff=False"
            )
        others = [
            i
            for i, engine in enumerate(self._engines)
            if i != index and i not in self._router.draining and not engine.errored
        ]
        if not others:
            raise ValueError(
                f"member {index} has no live member to hand its requests to: "
                "drain it with handoff=False"
            )

    def readmit(self, index: int) -> None:
        """Route new requests to member ``index`` again (after ``drain``); any thread.

        A no-op for a member that isn't drained. A drain still waiting
        returns once the member has nothing in flight, as before.

        Raises:
            IndexError: no member ``index``.
        """
        index = self._checked_index(index)
        with self._lock:
            self._router.draining -= {index}

    @property
    def drained(self) -> frozenset[int]:
        """The members the pool routes no new request to: ``drain`` called, ``readmit`` not yet.

        A member is in it from the moment ``drain`` is called, while its
        requests move or finish, until it is readmitted (during a ``rolling``
        call, the member being rolled). Never blocks; any thread.
        """
        with self._lock:
            return self._router.draining

    @contextlib.asynccontextmanager
    async def draining(
        self, index: int, *, handoff: bool = True, timeout: float | None = None
    ) -> AsyncIterator[Drained]:
        """``drain(index, ...)`` on entry, ``readmit(index)`` on exit, whatever the exit.

        ``async with pool.draining(0) as drained:`` runs the block once
        member 0 has nothing in flight; raises as ``drain``.
        """
        drained = await self.drain(index, handoff=handoff, timeout=timeout)
        try:
            yield drained
        finally:
            self.readmit(index)

    async def rolling(
        self, fn: Callable[[AsyncEngine], Awaitable[object]], *, handoff: bool = True
    ) -> list[Drained]:
        """For each member in turn: drain it, ``await fn(engine)``, readmit it.

        The pool keeps serving throughout: while one member is drained, the
        others take its requests (``handoff``) and every new one. ``fn`` may
        do anything to the drained member: ``engine.restart()`` (a rebuild,
        with new arguments or not), a weight update through
        ``collective_rpc`` or ``run_on_engine``, a cache reset. A request
        handed over continues under the weights of the member it moved to,
        so during a weight update one request may be computed under two sets
        of weights; with ``handoff=False`` each request finishes on the
        member that began it, under one set (the drain then waits for the
        member's requests to end). Dead members are skipped.

        Returns each member's ``Drained`` record, in order. If ``fn`` or a
        drain raises, the member is readmitted, the roll stops there and the
        error propagates; the members rolled so far stay as ``fn`` left them.

        Raises:
            ValueError: with ``handoff``, a pool of one member, or members
                without a ``RestartPolicy`` (checked before anything is drained);
                and as ``drain``.
            EngineClosedError: the pool was closed.
        """
        self._check_open()
        if handoff:
            with self._lock:
                self._check_handoff(-1)
                if len(self._engines) < 2:
                    raise ValueError("a rolling hand-over needs two members: use handoff=False")
        records = []
        for index, engine in enumerate(self._engines):
            if engine.errored:
                continue
            async with self.draining(index, handoff=handoff) as drained:
                await fn(engine)
            records.append(drained)
        return records

    def _checked_index(self, index: object) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"a member index is an int, not {type(index).__name__}")
        if not 0 <= index < len(self._engines):
            raise IndexError(f"the pool has no member {index} (it has {len(self._engines)})")
        return index

    # -- controls ------------------------------------------------------------------

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> list[bool]:
        """Reset every engine's prefix cache, concurrently; return each engine's answer.

        The list follows ``engines``; each answer is ``AsyncEngine.reset_prefix_cache``'s,
        and False for a dead engine. The pool forgets the prefixes of the
        engines that answered True, since their caches no longer hold them.

        Raises:
            EngineDeadError: every engine is dead.
            EngineClosedError: the pool was closed.
        """
        self._check_open()
        if all(engine.errored for engine in self._engines):
            raise self._all_dead()
        results = await gather(
            functools.partial(self._reset_one, engine, reset_running_requests, reset_connector)
            for engine in self._engines
        )
        with self._lock:
            self._router.prefixes.forget(lambda index: results[index])
        return results

    @staticmethod
    async def _reset_one(engine: AsyncEngine, running: bool, connector: bool) -> bool:
        try:
            return await engine.reset_prefix_cache(running, connector)
        except (EngineDeadError, EngineClosedError):
            return False

    def stats(self) -> EngineStats:
        """The engines' ``stats()`` combined; never blocks, safe from any thread.

        Counts and rates are summed over the engines (dead ones keep what they
        counted), ``last_step_seconds`` is the largest, ``seconds_since_last_step``
        the smallest, ``loops_served`` the largest (a loop may use several engines),
        and ``paused`` is whether any engine is paused or held.
        """
        return EngineStats.combine([engine.stats() for engine in self._engines])

    async def check_health(self, stall_timeout: float | None = None) -> None:
        """Raise unless the pool can serve: some engine is alive and none of the live ones stalls.

        Never waits for a worker. A dead engine alone doesn't fail the check
        (the pool routes around it); a stalled live one does, since requests
        routed to it make no progress.

        Raises:
            EngineClosedError: the pool was closed.
            EngineDeadError: every engine is dead.
            EngineStalledError: a live engine is stalled (``AsyncEngine.check_health``).
        """
        self._check_open()
        live = self._live()
        for engine in live:
            await engine.check_health(stall_timeout)

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """``pause_generation`` on every live engine, concurrently; returns once all have.

        Raises as ``AsyncEngine.pause_generation`` (the first error of any
        engine), and ``EngineDeadError`` if every engine is dead.
        """
        mode = checked_pause_mode(mode)
        self._check_open()
        await self._on_live(lambda e: e.pause_generation(mode=mode, clear_cache=clear_cache))

    async def resume_generation(self) -> None:
        """``resume_generation`` on every live engine, concurrently."""
        self._check_open()
        await self._on_live(lambda e: e.resume_generation())

    async def is_paused(self) -> bool:
        """Whether ``pause_generation`` is in force on any live engine."""
        self._check_open()
        return any([await engine.is_paused() for engine in self._live()])

    def _live(self) -> list[AsyncEngine]:
        live = [engine for engine in self._engines if not engine.errored]
        if not live:
            raise self._all_dead()
        return live

    async def _on_live(self, call: Callable[[AsyncEngine], Awaitable[None]]) -> None:
        # An engine that dies meanwhile has ended its own streams: skip it.
        async def one(engine: AsyncEngine) -> None:
            try:
                await call(engine)
            except EngineDeadError:
                if not engine.errored:
                    raise

        await gather(functools.partial(one, engine) for engine in self._live())

    def _all_dead(self) -> BaseException:
        dead = [
            error
            for engine in self._engines
            if engine.errored and isinstance(error := engine.dead_error, Exception)
        ]
        if not dead:
            return EngineClosedError()  # every engine was closed on its own
        return EngineDeadError(ExceptionGroup("every engine in the pool is dead", dead))
