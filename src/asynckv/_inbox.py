"""The inbox: the one object that both the event loops and the worker touch.

Any thread may ``put``; only the worker thread ``take``s. A lock is held just
for an append (or a swap of the whole queue) and the wake-up, so a loop never
waits on the worker's work. Commands come out in the order they went in.
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

    def put(self, item: T) -> None:
        """Append ``item`` and wake the consumer; raise the closing error if closed."""
        with self._cond:
            if self._error is not None:
                raise self._error
            self._items.append(item)
            if len(self._items) == 1:
                self._cond.notify()

    def take(self, block: bool) -> deque[T]:
        """Remove and return everything queued now, waiting for one item if ``block``.

        Items put while the caller works on this batch wait for the next call,
        so a burst of commands can't starve the engine's steps.
        """
        with self._cond:
            while block and not self._items and self._error is None:
                self._cond.wait()
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
