"""The restart policy and the pure bookkeeping of an engine's deaths.

Pure code, no threads: ``RestartPolicy`` is a frozen value the user makes on
any thread; ``Deaths`` is kept by the worker thread alone, which asks it, at
each death, whether the policy allows one more restart. The tests call it
with made-up clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._types import RestartPolicy

__all__ = ("Deaths",)


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
