"""The inbox on its own: order, wake-ups and close, across threads."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from asynckv._bridge._channel import Inbox


def test_fifo_and_non_blocking_take() -> None:
    """Items come out in the order they went in; a non-blocking take of nothing is empty."""
    inbox: Inbox[int] = Inbox()
    assert inbox.take(block=False) == deque()
    for i in range(5):
        inbox.put(i)
    assert list(inbox.take(block=True)) == [0, 1, 2, 3, 4]
    assert len(inbox) == 0


def test_nudge_wakes_a_waiting_take_once() -> None:
    """A nudge ends a blocked take with an empty batch; the next take waits again."""
    inbox: Inbox[int] = Inbox()
    taken: list[deque[int]] = []
    waiting = threading.Thread(target=lambda: taken.append(inbox.take(block=True)))
    waiting.start()
    inbox.nudge()
    waiting.join(30)
    assert not waiting.is_alive() and taken == [deque()]
    # A nudge is consumed by the take it woke: this one needs an item.
    waiting = threading.Thread(target=lambda: taken.append(inbox.take(block=True)))
    waiting.start()
    inbox.put(7)
    waiting.join(30)
    assert taken[-1] == deque([7])


def test_nudge_before_take_is_not_lost() -> None:
    """A nudge that comes before the consumer waits still ends its next wait."""
    inbox: Inbox[int] = Inbox()
    inbox.nudge()
    assert inbox.take(block=True) == deque()


def test_close_wakes_and_refuses() -> None:
    """close() ends a blocked take, returns what was queued, and later puts raise its error."""
    inbox: Inbox[int] = Inbox()
    inbox.put(1)
    assert list(inbox.close(RuntimeError("closed"))) == [1]
    assert inbox.take(block=True) == deque()
    with pytest.raises(RuntimeError, match="closed"):
        inbox.put(2)
    assert inbox.closed and isinstance(inbox.error, RuntimeError)
