"""The restart policy and the pure bookkeeping of an engine's deaths.

Pure code, no threads: ``RestartPolicy`` is a frozen value the user makes on
any thread; ``Deaths`` is kept by the worker thread alone, which asks it, at
each death, whether the policy allows one more restart. The tests call it
with made-up clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ("Deaths", "RestartPolicy")


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Restart a dead engine at most ``max_restarts`` times within any ``window`` seconds.

    With a policy, a death of the engine (a killed engine-core process, a
    raising ``step()``) no longer ends the streams: the worker rebuilds the
    engine and resumes every unfinished request from its last token
    (docs/reliability.md, "Restart and resume"). A death beyond the policy,
    or a rebuild that fails, ends everything with ``EngineDeadError`` as
    without one; its message names each death.

    Raises:
        ValueError: a negative ``max_restarts`` or a ``window`` that is not positive.
    """

    max_restarts: int = 3
    window: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise TypeError(f"max_restarts must be an int, got {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window > 0:
            raise ValueError(f"window must be > 0 seconds, got {self.window}")


@dataclass(slots=True)
class Deaths:
    """Every death of one engine, and whether the policy allows another restart."""

    policy: RestartPolicy
    causes: list[BaseException] = field(default_factory=list)
    """Each death's cause, in order (all of them, not only those in the window)."""
    times: list[float] = field(default_factory=list)
    restarts: int = 0
    """Restarts begun so far."""

    def record(self, cause: BaseException, now: float) -> bool:
        """Note a death at ``now`` (monotonic seconds); return whether to restart.

        A restart is allowed while the deaths within the last ``window``
        seconds, this one included, number at most ``max_restarts``.
        """
        self.causes.append(cause)
        self.times.append(now)
        recent = sum(1 for t in self.times if now - t < self.policy.window)
        if recent > self.policy.max_restarts:
            return False
        self.restarts += 1
        return True
