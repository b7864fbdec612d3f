"""The worker's lifecycle as a pure machine (pure code): states that carry their data.

Pure code, no threads and no engine. The ``Registry`` holds one ``State``
value and replaces it, under its lock, with what these functions return
(worker thread, and ``die``/``close`` from any thread); any thread reads it
(one reference). ``Deaths`` is the restart policy's bookkeeping, kept by the
worker thread alone. The tests drive all of it with made-up clocks
(tests/unit/test_life.py).

The states::

    New -> Starting -> Running <-> Restarting    (Restarting only with a RestartPolicy)
    Running <-> Rebuilding                       (a planned restart: ``engine.restart()``)
    any but Closed -> Dead -> Closed             (a death, then a close)
    any but Closed -> Closed                     (a close)

Once ``Closed``, nothing leaves it; once ``Dead``, only a close does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .._types import RestartPolicy

__all__ = (
    "Closed",
    "Dead",
    "Deaths",
    "GiveUp",
    "New",
    "Rebuild",
    "Rebuilding",
    "Restarting",
    "Running",
    "Starting",
    "State",
    "close",
    "die",
    "died",
    "planned",
    "restarting",
    "running",
    "start",
)


@dataclass(frozen=True, slots=True)
class New:
    """Made, not started."""


@dataclass(frozen=True, slots=True)
class Starting:
    """``start()`` was called: the engine is being built."""


@dataclass(frozen=True, slots=True)
class Running:
    """An engine is built and served."""


@dataclass(frozen=True, slots=True)
class Restarting:
    """The engine died and is being rebuilt under a ``RestartPolicy``."""

    cause: BaseException
    """The death that began this restart."""


@dataclass(frozen=True, slots=True)
class Rebuilding:
    """A planned restart (``engine.restart()``): the engine is rebuilt, not dead.

    Not a death: the ``RestartPolicy`` doesn't count it.
    """


@dataclass(frozen=True, slots=True)
class Dead:
    """The engine died for good: every later call raises ``error``."""

    error: BaseException
    """The ``EngineDeadError``."""


@dataclass(frozen=True, slots=True)
class Closed:
    """Closed (after a death or not): every later call raises ``error``."""

    error: BaseException
    """Why it ended first: the ``EngineClosedError``, or an earlier death's ``EngineDeadError``."""
    dead_error: BaseException | None = None
    """The ``EngineDeadError`` if it died before it was closed."""


State = New | Starting | Running | Restarting | Rebuilding | Dead | Closed


@dataclass(frozen=True, slots=True)
class Deaths:
    """Every death of one engine, and whether the policy allows another restart."""

    policy: RestartPolicy
    causes: tuple[BaseException, ...] = ()
    """Each death's cause, in order (all of them, not only those in the window)."""
    times: tuple[float, ...] = ()
    restarts: int = 0
    """Restarts begun so far."""

    def record(self, cause: BaseException, now: float) -> tuple[Deaths, bool]:
        """These deaths and one more at ``now`` (monotonic seconds), and whether to restart.

        A restart is allowed while the deaths within the last ``window``
        seconds, this one included, number at most ``max_restarts``.
        """
        times = (*self.times, now)
        recent = sum(1 for t in times if now - t < self.policy.window)
        allowed = recent <= self.policy.max_restarts
        after = replace(
            self,
            causes=(*self.causes, cause),
            times=times,
            restarts=self.restarts + allowed,
        )
        return after, allowed


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Build the engine again and resume its requests."""

    deaths: Deaths


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Don't restart: die with every death's cause (``deaths.causes``)."""

    deaths: Deaths


def error_of(state: State) -> BaseException | None:
    """Why it ended (``Dead`` or ``Closed``), else None."""
    match state:
        case Dead(error) | Closed(error):
            return error
        case _:
            return None


def dead_error_of(state: State) -> BaseException | None:
    """The ``EngineDeadError`` if the engine died, even once closed after; else None."""
    match state:
        case Dead(error):
            return error
        case Closed(_, dead):
            return dead
        case _:
            return None


def start(state: State) -> State:
    """``start()``: New -> Starting; any other state stays."""
    return Starting() if isinstance(state, New) else state


def running(state: State) -> State:
    """An engine is served: Starting, Restarting or Rebuilding -> Running; any other stays."""
    return Running() if isinstance(state, Starting | Restarting | Rebuilding) else state


def planned(state: State) -> tuple[State, bool]:
    """A planned restart: Running -> Rebuilding, and whether it may go ahead.

    Only a running engine is rebuilt on request; in any other state the state
    stays and the answer is False (the worker then refuses the restart).
    """
    if isinstance(state, Running):
        return Rebuilding(), True
    return state, False


def restarting(state: State) -> bool:
    """Whether an engine is being rebuilt, after a death or on request."""
    return isinstance(state, Restarting | Rebuilding)


def died(
    state: State, deaths: Deaths, cause: BaseException, now: float
) -> tuple[State, Rebuild | GiveUp]:
    """A death at ``now`` under the policy that ``deaths`` keeps: restart, or give up.

    Once ended (dead or closed meanwhile) there is nothing to restart, and
    the death isn't counted. A death beyond the policy leaves the state as it
    is: the worker then dies (``die``) with every cause.
    """
    if isinstance(state, Dead | Closed):
        return state, GiveUp(deaths)
    after, allowed = deaths.record(cause, now)
    if not allowed:
        return state, GiveUp(after)
    return Restarting(cause), Rebuild(after)


def die(state: State, error: BaseException) -> tuple[State, bool]:
    """A death for good, with its ``EngineDeadError``: the next state, and whether it ends now.

    Ignored once dead or closed (the state is returned as it is).
    """
    if isinstance(state, Dead | Closed):
        return state, False
    return Dead(error), True


def close(state: State, error: BaseException) -> tuple[State, bool]:
    """A close, with its ``EngineClosedError``: the next state, and whether it ends now.

    After a death it only records the close (not the first end); once closed,
    the state is returned as it is.
    """
    match state:
        case Closed():
            return state, False
        case Dead(dead):
            return Closed(dead, dead), False
        case _:
            return Closed(error), True
