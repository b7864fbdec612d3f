"""The inbox: the one object that both the event loops and the worker touch.

Any thread may ``put``; only the worker thread ``take``s. A lock is held just
for an append (or a swap of the whole queue) and the wake-up, so a loop never
waits on the worker's work. Commands come out in the order they went in.
``nudge`` wakes a waiting ``take`` without a command: vLLM's output thread
uses it to say that the engine core's next output has arrived.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

__all__ = ("Inbox",)

T = TypeVar("T")


class Inbox(Generic[T]):
    """A FIFO of commands for one consumer thread, closable with an error.

    Thread-safe. Once closed, ``put`` raises the closing error, so a caller
    learns at once that nobody will read its command.
    """

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._error: BaseException | None = None
        self._nudged = False

    def put(self, item: T) -> None:
        """Append ``item`` and wake the consumer; raise the closing error if closed."""
        with self._cond:
            if self._error is not None:
                raise self._error
            self._items.append(item)
            if len(self._items) == 1:
                self._cond.notify()

    def nudge(self) -> None:
        """Wake the consumer's ``take``, or its next one, even if nothing is queued."""
        with self._cond:
            self._nudged = True
            self._cond.notify()

    def take(self, block: bool, timeout: float | None = None) -> deque[T]:
        """Remove and return everything queued now, waiting for one item if ``block``.

        A ``nudge`` since the last call ends the wait too (then the batch may
        be empty), and so does ``timeout`` seconds passing. Items put while the
        caller works on this batch wait for the next call, so a burst of
        commands can't starve the engine's steps.
        """
        with self._cond:
            if block and not self._items and not self._nudged and self._error is None:
                # One wait: a spurious wake-up returns an empty batch, which the
                # worker treats like a timeout (it looks again), never as a command.
                self._cond.wait(timeout)
            self._nudged = False
            items, self._items = self._items, deque()
            return items

    def close(self, error: BaseException) -> deque[T]:
        """Refuse further puts with ``error`` and return what was still queued.

        Idempotent: a second close keeps the first error and returns nothing.
        """
        with self._cond:
            if self._error is None:
                self._error = error
            items, self._items = self._items, deque()
            self._cond.notify_all()
            return items

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """The error ``close`` was called with, if it was."""
        return self._error

    def __len__(self) -> int:
        return len(self._items)
