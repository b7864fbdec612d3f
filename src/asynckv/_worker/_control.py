"""Admission, holds and pauses: named states and pure transitions (pure code, no threads).

Pure code: no threads, no engine, no I/O. Each transition takes a
``Control`` and returns the next one with the ``Effect``s to carry out.
The worker thread calls them under the registry's lock (``_registry.py``)
and carries out the effects after releasing it; the tests call them with
no threads at all. Requests (``A``), replies (``R``) and loops are opaque
here: the machine only moves them between states.

The states (docs/reset-and-pause.md has the table of every combination):

- ``Phase.RUNNING``: requests are admitted and stepped.
- ``Phase.PAUSED``: ``pause_generation`` "abort" or "wait": new requests are
  parked; requests in flight still step ("wait" drains them).
- ``Phase.FROZEN``: ``pause_generation`` "keep": new requests are parked and
  those in flight are frozen: no step runs until ``resume``.

Orthogonal to the phase, ``holds`` (``paused()`` blocks) stop the stepping
while any is active; ``pending`` holds wait for their step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from .._errors import EngineHeldError
from .._types import PauseMode

__all__ = (
    "Abort",
    "AbortAll",
    "Admit",
    "Answer",
    "Control",
    "Drain",
    "Effect",
    "Fail",
    "PauseCore",
    "PendingHold",
    "Phase",
    "ResetCache",
    "ResumeCore",
)

A = TypeVar("A")  # a request waiting to be admitted (the worker's Add command)
R = TypeVar("R")  # where an answer goes (the worker's Reply)


class Phase(enum.Enum):
    """Where ``pause_generation`` / ``resume_generation`` left the engine."""

    RUNNING = "running"
    PAUSED = "paused"
    FROZEN = "frozen"


@dataclass(frozen=True, slots=True)
class PendingHold(Generic[R]):
    """A ``paused(at_step=k)`` waiting for step ``k`` to complete."""

    token: Hashable
    at_step: int
    reply: R


@dataclass(frozen=True, slots=True)
class Drain(Generic[R]):
    """A ``pause_generation("wait")`` waiting for the requests in flight to finish."""

    reply: R
    clear_cache: bool


# -- effects: what the worker does once the transition is made ----------------------


@dataclass(frozen=True, slots=True)
class Admit(Generic[A]):
    """Add this request to the engine."""

    request: A


@dataclass(frozen=True, slots=True)
class Abort(Generic[A]):
    """Admit this parked request and abort it at once, so it ends like any aborted one."""

    request: A


@dataclass(frozen=True, slots=True)
class AbortAll:
    """Abort every request in flight."""

    why: str


@dataclass(frozen=True, slots=True)
class Answer(Generic[R]):
    """Answer ``reply`` with ``value``."""

    reply: R
    value: object = None


@dataclass(frozen=True, slots=True)
class Fail(Generic[R]):
    """Answer ``reply`` with ``error``."""

    reply: R
    error: BaseException


@dataclass(frozen=True, slots=True)
class ResetCache:
    """Reset the prefix cache (preempting running requests if ``running``)."""

    running: bool


@dataclass(frozen=True, slots=True)
class PauseCore:
    """Freeze a separate engine-core process's own scheduler ("keep")."""

    clear_cache: bool


@dataclass(frozen=True, slots=True)
class ResumeCore:
    """Undo ``PauseCore``."""


Effect = Admit[A] | Abort[A] | AbortAll | Answer[R] | Fail[R] | ResetCache | PauseCore | ResumeCore


@dataclass(frozen=True, slots=True)
class Control(Generic[A, R]):
    """The whole admission / hold / pause state of one worker.

    ``core`` is fixed at build: whether the engine has a separate engine-core
    process, which steps on its own and so must be frozen by its own
    scheduler for "keep".
    """

    core: bool = False
    phase: Phase = Phase.RUNNING
    holds: frozenset[Hashable] = frozenset()
    pending: tuple[PendingHold[R], ...] = ()
    drains: tuple[Drain[R], ...] = ()
    parked: tuple[A, ...] = ()
    core_paused: bool = False

    @property
    def stepping(self) -> bool:
        """Whether steps may run (given requests): no hold, not frozen."""
        return not self.holds and self.phase is not Phase.FROZEN

    @property
    def admitting(self) -> bool:
        """Whether new requests go to the engine rather than being parked."""
        return self.phase is Phase.RUNNING

    # -- requests -------------------------------------------------------------

    def add(self, request: A) -> tuple[Control[A, R], list[Effect[A, R]]]:
        """A new request: admitted now, or parked while paused."""
        if self.admitting:
            return self, [Admit(request)]
        return replace(self, parked=(*self.parked, request)), []

    def abort_parked(self, match: Callable[[A], bool]) -> tuple[Control[A, R], list[Effect[A, R]]]:
        """Abort the parked requests that ``match``; unknown ids are a no-op."""
        hit = [a for a in self.parked if match(a)]
        if not hit:
            return self, []
        kept = tuple(a for a in self.parked if not match(a))
        return replace(self, parked=kept), [Abort(a) for a in hit]

    def forget(self, match: Callable[[A], bool]) -> Control[A, R]:
        """Drop the parked requests that ``match`` (their loop closed: nobody reads them)."""
        return replace(self, parked=tuple(a for a in self.parked if not match(a)))

    # -- holds ----------------------------------------------------------------

    def hold(
        self,
        token: Hashable,
        at_step: int | None,
        steps: int,
        reply: R,
        caller_holds: frozenset[Hashable],
    ) -> tuple[Control[A, R], list[Effect[A, R]]]:
        """``paused(at_step)``: hold now, after step ``at_step``, or refuse."""
        if at_step is None or at_step == steps:
            return replace(self, holds=self.holds | {token}), [Answer(reply, steps)]
        if at_step < steps:
            error = ValueError(f"step {at_step} has passed: {steps} steps are done")
            return self, [Fail(reply, error)]
        mine = caller_holds & self.holds or any(
            h.token in caller_holds and h.at_step < at_step for h in self.pending
        )
        if mine:
            call = f"paused(at_step={at_step})"
            why = f"the caller's own paused() block holds the engine at step {steps}"
            return self, [Fail(reply, EngineHeldError(call, why))]
        pending = (*self.pending, PendingHold(token, at_step, reply))
        return replace(self, pending=pending), []

    def release(self, token: Hashable) -> Control[A, R]:
        """End a hold, active or still pending (its block exited or was cancelled)."""
        pending = tuple(h for h in self.pending if h.token != token)
        return replace(self, holds=self.holds - {token}, pending=pending)

    def stepped(self, steps: int) -> tuple[Control[A, R], list[Effect[A, R]]]:
        """Step ``steps`` just completed: the holds waiting for it take effect."""
        due = [h for h in self.pending if h.at_step == steps]
        if not due:
            return self, []
        pending = tuple(h for h in self.pending if h.at_step != steps)
        holds = self.holds | {h.token for h in due}
        return replace(self, holds=holds, pending=pending), [Answer(h.reply, steps) for h in due]

    # -- pause and resume -----------------------------------------------------

    def pause(
        self,
        mode: PauseMode,
        clear_cache: bool,
        reply: R,
        in_flight: bool,
        caller_holds: frozenset[Hashable],
    ) -> tuple[Control[A, R], list[Effect[A, R]]]:
        """``pause_generation(mode, clear_cache)``; see the module docstring."""
        if mode == "keep":
            keep: list[Effect[A, R]] = []
            if self.phase is Phase.FROZEN:
                # Already frozen (and the core paused): only the cache is left to clear.
                keep += [ResetCache(running=True)] if clear_cache else []
            elif self.core:
                keep.append(PauseCore(clear_cache))
            elif clear_cache:
                keep.append(ResetCache(running=True))
            core_paused = self.core_paused or self.core
            frozen = replace(self, phase=Phase.FROZEN, core_paused=core_paused)
            return frozen, [*keep, Answer(reply)]
        if mode == "wait" and in_flight:
            reason = None
            if self.phase is Phase.FROZEN:
                reason = "a 'keep' pause freezes the requests in flight until resume_generation()"
            elif caller_holds & self.holds:
                reason = "the caller's own paused() block stops the stepping"
            if reason is not None:
                call = "pause_generation(mode='wait')"
                return self, [Fail(reply, EngineHeldError(call, reason))]
        thawed, thaw = self._thaw()
        paused = replace(thawed, phase=Phase.PAUSED)
        if mode == "abort":
            # Abort before thawing: a thawed core would step the doomed requests once more.
            effects: list[Effect[A, R]] = [AbortAll("paused"), *thaw]
            if clear_cache:
                effects.append(ResetCache(running=False))
            return paused, [*effects, Answer(reply)]
        # "wait": answered by drained() once nothing is unfinished (maybe at once).
        return replace(paused, drains=(*paused.drains, Drain(reply, clear_cache))), thaw

    def drained(self) -> tuple[Control[A, R], list[Effect[A, R]]]:
        """Nothing is unfinished any more: answer the "wait" pauses."""
        if not self.drains:
            return self, []
        effects: list[Effect[A, R]] = []
        if any(d.clear_cache for d in self.drains):
            effects.append(ResetCache(running=False))
        effects += [Answer(d.reply) for d in self.drains]
        return replace(self, drains=()), effects

    def resume(self, reply: R) -> tuple[Control[A, R], list[Effect[A, R]]]:
        """``resume_generation()``: thaw, answer the waits, admit what was parked, in order."""
        thawed, effects = self._thaw()
        effects += [Answer(d.reply) for d in thawed.drains]
        effects += [Admit(a) for a in thawed.parked]
        running = replace(thawed, phase=Phase.RUNNING, drains=(), parked=())
        return running, [*effects, Answer(reply)]

    def _thaw(self) -> tuple[Control[A, R], list[Effect[A, R]]]:
        if self.core_paused:
            return replace(self, core_paused=False), [ResumeCore()]
        return self, []

    # -- the end --------------------------------------------------------------

    def waiting(self) -> tuple[list[A], list[R]]:
        """Everything that still waits: parked requests, and replies of holds and drains."""
        replies = [h.reply for h in self.pending] + [d.reply for d in self.drains]
        return list(self.parked), replies
