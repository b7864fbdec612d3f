"""Step telemetry, the worker thread's side: a ``StepRecord`` per engine step, to every reader.

``StepHub`` belongs to one worker: the worker thread calls ``before`` and
``after`` around each ``step()`` (and only while somebody listens: with no
reader, a step costs one empty-tuple test), and ``end`` when the engine dies
or closes (any thread). ``add`` and ``remove`` run on a reader's loop or in
a finaliser, under the hub's lock, which guards only the tuple of feeds.
Each record reaches a reader's loop in the worker's one batch per pass
(``Outbox``), never as a wake-up of its own. The readers are ``Feed``s: the
loop side's ``StepStream`` (``_loop/_steps.py``) is one.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from .._stats import StepRecord
from .._vllm import StepTap, tap_steps

if TYPE_CHECKING:
    from .._bridge._channel import Outbox
    from .._bridge._loops import Loop
    from .._vllm import EngineLike

__all__ = ("Feed", "StepHub")


class Feed(Protocol):
    """A reader of step records; the hub posts to it on its loop."""

    @property
    def loop(self) -> Loop: ...

    def _push(self, record: StepRecord) -> None: ...

    def _end(self, error: BaseException) -> None: ...


class StepHub:
    """One worker's readers of step records; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.feeds: tuple[Feed, ...] = ()
        """Replaced whole under the lock, read by the worker without it (one reference)."""
        self._error: BaseException | None = None
        self._tap: StepTap | None = None
        self._began = 0.0

    def add(self, feed: Feed) -> None:
        """Start sending records to ``feed`` (ended at once if the engine has)."""
        with self._lock:
            error = self._error
            if error is None:
                self.feeds = (*self.feeds, feed)
        if error is not None:
            feed._end(error)

    def remove(self, feed: Feed) -> None:
        """Stop sending records to ``feed`` (any thread)."""
        with self._lock:
            self.feeds = tuple(f for f in self.feeds if f is not feed)

    def forget(self, loop: Loop) -> None:
        """Drop the feeds of a loop that has ended (worker thread)."""
        with self._lock:
            self.feeds = tuple(f for f in self.feeds if f.loop is not loop)

    def before(self, engine: EngineLike) -> None:
        """Get ready to count the step about to run (worker thread, only with feeds)."""
        if self._tap is None:
            self._tap = tap_steps(engine, lambda: bool(self.feeds))
        self._tap.reset()
        self._began = time.monotonic()

    def after(self, step: int, outputs: list[Any], outbox: Outbox) -> None:
        """Make the step's record and post it to every feed (worker thread)."""
        took = time.monotonic() - self._began
        tap = self._tap
        assert tap is not None  # before() ran for this step
        finished = sum(1 for out in outputs if out.finished)
        if tap.seen:
            requests, tokens, prefill = tap.requests, tap.tokens, tap.prefill
        else:  # this vLLM lays out its output processing differently
            requests, tokens, prefill = len(outputs), 0, 0
        record = StepRecord(
            step=step,
            started=self._began,
            duration=took,
            requests=requests,
            tokens=tokens,
            prefill=prefill,
            decode=requests - prefill,
            finished=finished,
            preemptions=tap.preemptions,
            running=tap.running,
            waiting=tap.waiting,
        )
        for feed in self.feeds:
            outbox.post(feed.loop, feed._push, record)

    def end(self, error: BaseException, outbox: Outbox) -> None:
        """End every feed with ``error`` (closed: iteration stops; dead: it raises)."""
        with self._lock:
            if self._error is None:
                self._error = error
            feeds, self.feeds = self.feeds, ()
        for feed in feeds:
            outbox.post(feed.loop, feed._end, error)
