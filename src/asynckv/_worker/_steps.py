"""Step telemetry: one ``StepRecord`` per engine step, to every ``steps()`` reader.

Two sides. ``StepHub`` belongs to one worker: the worker thread calls
``before`` and ``after`` around each ``step()`` (and only while somebody
listens: with no reader, a step costs one empty-tuple test), and ``end``
when the engine dies or closes (any thread). ``add`` and ``remove`` run on a
reader's loop or in a finaliser, under the hub's lock, which guards only the
tuple of feeds. Each record reaches a reader's loop in the worker's one
batch per pass (``Outbox``), never as a wake-up of its own.

``StepStream`` is the reader's side, on the loop that made it: a bounded
buffer that drops the oldest record when full and counts what it dropped,
so a slow reader never holds the worker back and costs constant memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._bridge._loops import current
from .._errors import EngineClosedError
from .._vllm import StepTap, tap_steps

if TYPE_CHECKING:
    from .._bridge._commands import Outbox
    from .._bridge._loops import Future, Loop
    from .._vllm import EngineLike

__all__ = ("StepHub", "StepRecord", "StepStream")


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


class StepStream:
    """The engine's steps as they happen: ``async for step in engine.steps(): ...``.

    Belongs to the loop that called ``steps()``. Yields one ``StepRecord``
    per step, in step order, from the first step after the call. It holds at
    most ``buffer`` records: when the reader falls behind, the oldest are
    dropped and counted in ``skipped`` (the gaps show in ``step`` numbers
    too); the worker never waits for a reader. Iteration ends when the
    stream is closed (``aclose()``, leaving ``async with``, or dropping it)
    or the engine closes; it raises ``EngineDeadError`` if the engine dies.
    """

    __slots__ = (
        "__weakref__",
        "_buffer",
        "_error",
        "_hub",
        "_new_future",
        "_waiter",
        "loop",
        "skipped",
    )

    def __init__(self, hub: StepHub, buffer: int) -> None:
        loop = current()
        self.loop: Loop = loop
        self._new_future = loop.futures()
        self._buffer: deque[StepRecord] = deque(maxlen=buffer)
        self._waiter: Future[None] | None = None
        self._error: BaseException | None = None
        self._hub: StepHub | None = hub
        self.skipped = 0
        """Records dropped because this reader was behind."""
        hub.add(self)

    # -- from the worker, on this stream's loop --------------------------------------

    def _push(self, record: StepRecord) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self.skipped += 1
        self._buffer.append(record)
        self._wake()

    def _end(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._hub = None
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the reader ---------------------------------------------------------------------

    def __aiter__(self) -> StepStream:
        return self

    async def __anext__(self) -> StepRecord:
        """The next step's record; ``StopAsyncIteration`` once closed."""
        while not self._buffer:
            if self._error is not None:
                if isinstance(self._error, EngineClosedError):
                    raise StopAsyncIteration
                raise self._error
            self._waiter = self._new_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._buffer.popleft()

    async def aclose(self) -> None:
        """Stop receiving records; what is buffered is dropped. Idempotent."""
        self.close()

    def close(self) -> None:
        """``aclose`` for any code on the stream's loop (and finalisers)."""
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.remove(self)
        self._buffer.clear()
        self._end(EngineClosedError())

    async def __aenter__(self) -> StepStream:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:
        hub = self._hub
        if hub is not None:
            hub.remove(self)


class StepHub:
    """One worker's readers of step records; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.feeds: tuple[StepStream, ...] = ()
        """Replaced whole under the lock, read by the worker without it (one reference)."""
        self._error: BaseException | None = None
        self._tap: StepTap | None = None
        self._began = 0.0

    def add(self, feed: StepStream) -> None:
        """Start sending records to ``feed`` (ended at once if the engine has)."""
        with self._lock:
            error = self._error
            if error is None:
                self.feeds = (*self.feeds, feed)
        if error is not None:
            feed._end(error)

    def remove(self, feed: StepStream) -> None:
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
