"""The reader's side of step telemetry: ``StepStream``, on the loop that made it.

Runs on that loop, except that the worker posts ``_push`` and ``_end`` to
it through its ``Outbox`` (``_worker/_steps.py``'s ``StepHub`` makes the
records, one per engine step, while anybody listens). A bounded buffer that
drops the oldest record when full and counts what it dropped, so a slow
reader never holds the worker back and costs constant memory.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .._bridge._loops import current
from .._errors import EngineClosedError
from .._stats import StepRecord

if TYPE_CHECKING:
    from .._bridge._loops import Future, Loop
    from .._worker._steps import StepHub

__all__ = ("StepRecord", "StepStream")


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
