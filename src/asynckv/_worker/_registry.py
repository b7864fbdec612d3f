"""The registry: what waits for the worker thread, behind one lock that any thread may take.

The worker thread changes it as it works; ``die`` (the worker or the watchdog
thread) and ``close`` (the closing thread) end it from elsewhere and fail
everything it holds. The lock is taken only in this module's methods, each
of which does bookkeeping alone (no engine call, no answer sent), so it is
held for microseconds. Whatever an ``end`` can't see any more (a command the
worker was applying when the end came) is reported back to the worker by the
method it calls, which then answers it with ``error``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from . import _life
from ._control import Control, Effect
from ._life import Closed, Dead, Deaths, GiveUp, New, Rebuild, Restarting

if TYPE_CHECKING:
    from .._bridge._channel import Add, Outbox, Reply, Sink
    from .._bridge._loops import Loop
    from ._resume import Progress

__all__ = ("Changed", "Ended", "Refused", "Registry", "Route")


class Pending(Protocol):
    """A command still queued: it can be answered with an error."""

    def fail(self, outbox: Outbox, error: BaseException) -> None: ...


class Queue(Protocol):
    """The registry's view of the worker's inbox: closed with the end's error."""

    def close(self, error: BaseException) -> Iterable[Pending]: ...


@dataclass(eq=False, slots=True)
class Route:
    """Where one admitted request's outputs go."""

    sink: Sink
    loop: Loop
    progress: Progress | None = None
    """What was sent, to resume it after a restart (only with a ``RestartPolicy``)."""

    def engine_ids(self, request_id: str) -> list[str]:
        """The ids of the engine requests that carry it now."""
        return [request_id] if self.progress is None else list(self.progress.engine_ids)


@dataclass(slots=True)
class Ended:
    """What an ``end`` took: everything that must now be answered with ``error``."""

    error: BaseException
    commands: list[Pending]
    sinks: list[Sink]
    replies: list[Reply]

    def fail(self, outbox: Outbox) -> None:
        """Post the failure of everything taken (from any thread)."""
        for command in self.commands:
            command.fail(outbox, self.error)
        for sink in self.sinks:
            outbox.post(sink.loop, sink.fail, self.error)
        for reply in self.replies:
            reply.fail(outbox, self.error)


if TYPE_CHECKING:
    ControlState = Control[Add, Reply]
    Transition = Callable[[ControlState], tuple[ControlState, list[Effect[Add, Reply]]]]


@dataclass(frozen=True, slots=True)
class Changed:
    """A control transition was made: carry out its effects."""

    effects: list[Effect[Add, Reply]]


@dataclass(frozen=True, slots=True)
class Refused:
    """No transition: the engine had ended; answer with ``error``."""

    error: BaseException


class Registry:
    """The routes, the admission/hold/pause state and the lifecycle of one worker.

    ``control``, ``routes`` and ``state`` may be read from any thread without
    the lock (a reference or a length: one word); every change goes through
    a method here, under the lock.
    """

    def __init__(self, inbox: Queue) -> None:
        self._lock = threading.Lock()
        self._inbox = inbox
        self.state: _life.State = New()
        """The lifecycle (``_life.py``): replaced whole, under the lock."""
        self.control: ControlState = Control()
        self.routes: dict[str, Route] = {}
        self.aliases: dict[str, Route] = {}
        """Engine ids of resumed completions (``n > 1``) -> their request's route."""
        self.stopped: list[str] = []
        """Engine requests ended by a stop string across a resume's join (to abort)."""
        self.idle: list[tuple[Reply, Any]] = []
        """Replies to answer (with their value) once nothing is in flight: a pool's drain
        (worker thread; ``end`` fails them)."""
        self.draining = False
        """Set once by ``Worker.close`` with a drain (the closing thread); read by the
        worker as it applies an ``Add``, which it then refuses. One word: no lock."""

    @property
    def error(self) -> BaseException | None:
        """Why it ended: the ``EngineClosedError`` or ``EngineDeadError`` (None while alive)."""
        return _life.error_of(self.state)

    @property
    def dead_error(self) -> BaseException | None:
        """The ``EngineDeadError`` if the engine died, even once closed after."""
        return _life.dead_error_of(self.state)

    @property
    def ended(self) -> bool:
        """Whether the engine is dead or closed."""
        return isinstance(self.state, Dead | Closed)

    @property
    def restarting(self) -> bool:
        """Whether the engine is being rebuilt, after a death or on request."""
        return _life.restarting(self.state)

    @property
    def restart_cause(self) -> BaseException | None:
        """While a dead engine is being rebuilt, the death that began it; else None."""
        state = self.state
        return state.cause if isinstance(state, Restarting) else None

    def start(self) -> None:
        """``start()`` was called (any thread)."""
        with self._lock:
            self.state = _life.start(self.state)

    def running(self) -> None:
        """An engine is served, first or rebuilt (worker thread)."""
        with self._lock:
            self.state = _life.running(self.state)

    def died(self, deaths: Deaths, cause: BaseException, now: float) -> Rebuild | GiveUp:
        """A death under a restart policy: move to ``Restarting`` or say to give up (worker)."""
        with self._lock:
            self.state, action = _life.died(self.state, deaths, cause, now)
            return action

    def planned(self) -> bool:
        """A planned restart: move to ``Rebuilding``; False if not running (worker)."""
        with self._lock:
            self.state, allowed = _life.planned(self.state)
            return allowed

    @property
    def in_flight(self) -> bool:
        """Whether any request is admitted or parked (one read each, no lock)."""
        return bool(self.routes) or bool(self.control.parked)

    def set_core(self, core: bool) -> None:
        """Record, once the engine is built, whether it has an engine-core process."""
        with self._lock:
            self.control = Control(core=core)

    def change(self, transition: Transition) -> Changed | Refused:
        """Make a control transition and return its effects, or the error if ended."""
        with self._lock:
            error = self.error
            if error is not None:
                return Refused(error)
            self.control, effects = transition(self.control)
            return Changed(effects)

    def add_route(self, request_id: str, route: Route) -> BaseException | None:
        """Route an admitted request's outputs; returns the error instead if ended."""
        with self._lock:
            if self.error is None:
                self.routes[request_id] = route
            return self.error

    def pop_route(self, request_id: str) -> Route | None:
        """Stop routing a request (aborted); None if unknown or finished."""
        with self._lock:
            route = self.routes.pop(request_id, None)
            if route is not None and route.progress is not None:
                self._unalias(route.progress)
            return route

    def _unalias(self, progress: Progress) -> None:
        if self.aliases:
            for engine_id in progress.engine_ids:
                self.aliases.pop(engine_id, None)

    def take_routes(self) -> list[tuple[str, Route]]:
        """Stop routing every request and return them (a pool member hands them over)."""
        with self._lock:
            taken = list(self.routes.items())
            self.routes, self.aliases = {}, {}
            return taken

    def put_routes(self, routes: list[tuple[str, Route]]) -> None:
        """Route again what ``take_routes`` took and nobody adopted."""
        with self._lock:
            for request_id, route in routes:
                self.routes[request_id] = route

    def readmitted(self, request_id: str, route: Route) -> None:
        """Route a resumed request's new engine ids (worker thread, during a restart)."""
        assert route.progress is not None
        with self._lock:
            for engine_id in route.progress.engine_ids:
                if engine_id != request_id:
                    self.aliases[engine_id] = route

    def dispatch(self, outputs: Iterable[Any], outbox: Outbox) -> tuple[int, int]:
        """Post each output to its stream; return (delivered, finished)."""
        delivered = finished = 0
        # Usually every stream is on one loop: its list of pushes is looked up once.
        last: Loop | None = None
        pushes: list[tuple[Sink, Any]] = []
        with self._lock:
            routes = self.routes
            for out in outputs:
                route = routes.get(out.request_id)
                if route is None:
                    route = self.aliases.get(out.request_id) if self.aliases else None
                    if route is None:
                        continue  # aborted since, or not ours
                if route.progress is not None:
                    progress = route.progress
                    out = progress.see(out)
                    if progress.stopped:
                        self.stopped += progress.stopped
                        progress.stopped = []
                    if out is None:
                        continue
                    if out.finished:
                        self._unalias(progress)
                if route.loop is not last:
                    last = route.loop
                    pushes = outbox.pushes(last)
                pushes.append((route.sink, out))
                delivered += 1
                if out.finished:
                    del routes[out.request_id]
                    finished += 1
        return delivered, finished

    def forget(self, loop: Loop) -> list[str]:
        """Drop a closed loop's routes and parked requests; return the ids to abort."""
        with self._lock:
            ids = [rid for rid, route in self.routes.items() if route.loop is loop]
            engine_ids = []
            for rid in ids:
                route = self.routes.pop(rid)
                engine_ids += route.engine_ids(rid)
                if route.progress is not None:
                    self._unalias(route.progress)
            self.control = self.control.forget(lambda add: add.sink.loop is loop)
        return engine_ids

    def end(self, closing: bool, error: BaseException) -> Ended | None:
        """Die (``closing`` False) or close: refuse every later command, take what waits.

        Returns None if that changes nothing (a death once ended, a close once
        closed); a close after a death only records the close.
        """
        with self._lock:
            before = self.state
            end = _life.close if closing else _life.die
            self.state, first = end(before, error)
            if self.state is before:
                return None
            if not first:
                return Ended(error, [], [], [])
            commands = list(self._inbox.close(error))
            parked, replies = self.control.waiting()
            replies = [*replies, *(reply for reply, _ in self.idle)]
            self.idle = []
            sinks = [route.sink for route in self.routes.values()]
            sinks += [add.sink for add in parked]
            self.routes = {}
            self.aliases = {}
            self.control = Control(core=self.control.core)
            return Ended(error, commands, sinks, replies)
