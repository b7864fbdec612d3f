"""The worker's counters: written on the worker thread, read by ``stats()`` on any thread.

``Counters`` is written by the worker thread only; any thread reads it
(``stats``, ``Worker.health``) without a lock: each field is one word, so a
read never blocks, but its fields may come from two adjacent steps.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .._stats import EngineStats

if TYPE_CHECKING:
    from .._bridge._loops import Loop

__all__ = ("Counters", "Health")


class Health(NamedTuple):
    """What ``check_health`` reads beyond ``EngineStats`` (any thread, no lock)."""

    dead_error: BaseException | None
    """The ``EngineDeadError`` if the engine died, even once closed after."""
    restart_cause: BaseException | None
    """While a dead engine is being rebuilt, the death that began it."""
    restarting: bool
    """Whether the engine is being rebuilt, after a death or on request."""
    in_step_since: float | None
    """When the ``step()`` now running began (``perf_counter``)."""
    last_step_end: float | None
    busy_since: float
    in_flight: int
    held: bool
    """Whether something stops the stepping (a ``paused()`` block, a "keep" pause)."""


@dataclass(slots=True)
class Counters:
    """What the worker counts as it works (worker thread only)."""

    steps: int = 0
    outputs_delivered: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    last_step_seconds: float = 0.0
    step_seconds_avg: float = 0.0
    last_step_end: float | None = None
    busy_since: float = 0.0
    """When the worker last went from no request to some."""
    in_step_since: float | None = None
    """When the ``step()`` now running began."""
    restarts: int = 0
    """Restarts of a dead engine completed (``RestartPolicy``)."""
    loops: weakref.WeakSet[Loop] = field(default_factory=weakref.WeakSet)

    def count_step(self, began: float) -> None:
        """Count one step that began at ``began`` (``perf_counter``) and just ended."""
        now = time.perf_counter()
        took = self.last_step_seconds = now - began
        # Interval between step ends, so the rate includes the worker's own overhead.
        interval = took if self.last_step_end is None else now - self.last_step_end
        avg = self.step_seconds_avg
        self.step_seconds_avg = interval if avg == 0.0 else 0.9 * avg + 0.1 * interval
        self.last_step_end = now
        self.steps += 1

    def stats(
        self, *, in_flight: int, waiting: int, paused: bool, commands_queued: int
    ) -> EngineStats:
        """These counters with the registry's states, as ``EngineStats`` (any thread)."""
        avg, last = self.step_seconds_avg, self.last_step_end
        return EngineStats(
            steps=self.steps,
            steps_per_second=1.0 / avg if avg else 0.0,
            last_step_seconds=self.last_step_seconds,
            seconds_since_last_step=None if last is None else time.perf_counter() - last,
            requests_in_flight=in_flight,
            requests_waiting=waiting,
            paused=paused,
            commands_queued=commands_queued,
            outputs_delivered=self.outputs_delivered,
            requests_finished=self.requests_finished,
            requests_aborted=self.requests_aborted,
            loops_served=len(self.loops),
            restarts=self.restarts,
        )
