"""The public records of what the engine did: frozen values, read on any thread.

Runs nowhere: frozen values. The worker thread makes them (``stats()`` reads
its counters from any thread, each field one machine word read without a
lock, so a snapshot is cheap and never blocks the loop, but its fields may
come from two adjacent steps); a ``StepRecord`` reaches its reader's loop in
the worker's batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ("EngineStats", "StepRecord")


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


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one engine step did, as the worker saw it.

    With vLLM's engine-core process (the default), a "step" is one call of
    ``LLMEngine.step()`` on the worker: it collects one output of the core,
    which schedules and runs on its own, and the counts are those of that
    output. In-process, it is the core's step itself.
    """

    step: int
    """The worker's step count after this step (1 for the first; ``stats().steps``)."""
    started: float
    """When ``step()`` was called (``time.monotonic``)."""
    duration: float
    """Seconds the worker spent in ``step()`` (in-process: the whole step)."""
    requests: int
    """Requests that got tokens in this step."""
    tokens: int
    """Tokens produced in this step, over all requests."""
    prefill: int
    """Of ``requests``, those whose prompt was processed in this step (their first token)."""
    decode: int
    """Of ``requests``, those that were decoding."""
    finished: int
    """Requests that finished in this step."""
    preemptions: int | None
    """Preemptions vLLM reported in this step's outputs; None where it reports none (stats off)."""
    running: int | None
    """Requests the core's scheduler had running, if vLLM reported it (stats on)."""
    waiting: int | None
    """Requests waiting in the core's scheduler, if vLLM reported it (stats on)."""
