"""Pacer: a stream's time-based interval, on the stream's event loop.

A stream with ``stream_interval`` > 0 wakes its consumer at most once per
interval: outputs that arrive sooner are merged into the one pending output
(``_Sink.push`` already merges DELTA outputs and replaces CUMULATIVE ones for
a slow consumer) and handed out when the interval has passed. The first
output and the final one always go out at once. Everything here runs on the
loop that owns the stream, so it needs no lock; the worker never sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ("Pacer",)


class Pacer:
    """When a stream's pending output may go to its consumer (loop thread only).

    ``held`` is True while an output waits for its interval; ``due()`` says
    whether it may go now (and then counts it as released), ``delay()`` how
    long until it may. ``clock`` is ``time.monotonic`` but for tests.
    """

    __slots__ = ("_clock", "_due", "_released", "held", "interval")

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._due = 0.0
        self._released = False  # the first output has gone out
        self.held = False

    def arrived(self, final: bool) -> bool:
        """An output was merged into the pending one: whether to wake the consumer now."""
        if final or not self._released or self._clock() >= self._due:
            self.release()
            return True
        self.held = True
        return False

    def due(self) -> bool:
        """Whether the pending output may be taken now (releasing it if so)."""
        if not self.held:
            return True
        if self._clock() >= self._due:
            self.release()
            return True
        return False

    def delay(self) -> float:
        """Seconds until the held output may go."""
        return max(0.0, self._due - self._clock())

    def release(self) -> None:
        """Hand the pending output out now; the next one waits a whole interval."""
        self.held = False
        self._released = True
        self._due = self._clock() + self.interval
