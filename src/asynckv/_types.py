"""The public value types, made and read on any thread: PauseMode, RestartPolicy, Drained.

Runs nowhere: a type alias and a frozen value, made on any thread and read
on any. At the bottom of the package: every room imports them, they import
nothing of asynckv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ("Drained", "PauseMode", "RestartPolicy")

PauseMode = Literal["abort", "wait", "keep"]
"""What ``pause_generation`` does with the requests in flight (``AsyncLLM``'s modes)."""


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


@dataclass(frozen=True, slots=True)
class Drained:
    """What ``AsyncEnginePool.drain`` did: the requests it moved, and those that stayed.

    Request ids (the pool's, or an engine's own for requests submitted to
    the member directly) that were unfinished on the member when the drain
    reached it, between two of its steps.
    """

    index: int
    """The member drained (its index in ``pool.engines``)."""
    moved: tuple[str, ...]
    """Handed to live members (``handoff=True``), to continue there from their last token."""
    stayed: tuple[str, ...]
    """Left to finish on the member (all of them with ``handoff=False``; with it, those no
    live member could take). Each had ended when the drain returned."""
