"""EngineStats: a snapshot of the worker's counters, read without asking the worker.

The worker thread writes the counters; any thread reads them. Each field is
one machine word read without a lock, so a snapshot is cheap and never blocks
the loop, but its fields may come from two adjacent steps.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ("EngineStats",)


class EngineStats(NamedTuple):
    """What the engine has done and holds, as of the moment ``stats()`` was called."""

    steps: int
    """Engine steps completed."""
    steps_per_second: float
    """Recent step rate while stepping (an exponential average; 0.0 before any step)."""
    last_step_seconds: float
    """How long the last ``step()`` took."""
    seconds_since_last_step: float | None
    """Time since the last step completed (None before any step)."""
    requests_in_flight: int
    """Requests admitted to the engine and not finished."""
    requests_waiting: int
    """Requests submitted while ``pause_generation()`` is in force, not yet admitted."""
    paused: bool
    """Whether ``pause_generation()`` is in force or a ``paused()`` block holds the engine."""
    commands_queued: int
    """Commands in the inbox that the worker has not taken yet."""
    outputs_delivered: int
    """Outputs handed to streams, abort outputs included."""
    requests_finished: int
    """Requests that ended with a final output from the engine (aborted ones included)."""
    requests_aborted: int
    """Requests aborted in the engine (by cancel, break, aclose, GC, abort() or a closed loop)."""
    loops_served: int
    """Distinct event loops that have submitted requests."""
    restarts: int = 0
    """Times a dead engine was rebuilt and its requests resumed (``RestartPolicy``)."""

    @classmethod
    def combine(cls, each: list[EngineStats]) -> EngineStats:
        """Several engines' stats as one (``AsyncEnginePool.stats``)."""
        since = [s.seconds_since_last_step for s in each if s.seconds_since_last_step is not None]
        return cls(
            steps=sum(s.steps for s in each),
            steps_per_second=sum(s.steps_per_second for s in each),
            last_step_seconds=max(s.last_step_seconds for s in each),
            seconds_since_last_step=min(since) if since else None,
            requests_in_flight=sum(s.requests_in_flight for s in each),
            requests_waiting=sum(s.requests_waiting for s in each),
            paused=any(s.paused for s in each),
            commands_queued=sum(s.commands_queued for s in each),
            outputs_delivered=sum(s.outputs_delivered for s in each),
            requests_finished=sum(s.requests_finished for s in each),
            requests_aborted=sum(s.requests_aborted for s in each),
            loops_served=max(s.loops_served for s in each),
            restarts=sum(s.restarts for s in each),
        )
