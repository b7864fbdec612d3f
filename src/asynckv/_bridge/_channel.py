"""Both threads: the channel from the loops to the worker and back (inbox, commands, outbox).

Both threads use it, each its own half. Any thread ``put``s commands in the
``Inbox``; only the worker thread ``take``s them. A lock is held just for an
append (or a swap of the whole queue) and the wake-up, so a loop never waits
on the worker's work, and commands come out in the order they went in.
``nudge`` wakes a waiting ``take`` without a command: vLLM's output thread
uses it to say that the engine core's next output has arrived.

Commands are built on an event loop (asyncio or trio) and applied on the
worker thread. Answers go back only through ``Outbox.flush``, which makes one
``Loop.post`` (``call_soon_threadsafe``, or trio's ``run_sync_soon``) per loop
per pass of the worker, however many requests and commands it answers: a step
with 200 streams on one loop costs that loop one wake-up.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .._log import emit
from .._types import PauseMode
from ._loops import current

if TYPE_CHECKING:
    from vllm import LLMEngine
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams

    from .._vllm import EngineLike, Prepared
    from ._loops import Future, Loop

__all__ = (
    "Abort",
    "Add",
    "Call",
    "Command",
    "Hold",
    "Inbox",
    "Outbox",
    "Pause",
    "Release",
    "Reply",
    "Reset",
    "Restart",
    "Resume",
    "Sink",
    "fail_all",
)

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


_Callback = tuple[Callable[..., None], tuple[Any, ...]]


class Sink(Protocol):
    """Where one request's outputs go: what the worker posts to, on the request's loop.

    The loop side's ``_Sink`` (``_loop/_stream.py``) is one; the worker never
    calls these methods itself, it posts them to ``loop`` through an ``Outbox``.
    """

    @property
    def loop(self) -> Loop:
        """The loop the request was made on, where every call below runs."""
        ...

    @property
    def request_id(self) -> str: ...

    def push(self, out: RequestOutput) -> None:
        """Take the request's next output."""

    def resumed(self) -> None:
        """Note that the request goes on, on a rebuilt engine."""

    def aborting(self, why: str) -> None:
        """Note why the request is being aborted (before its last outputs)."""

    def abort(self) -> None:
        """End the request as aborted (a no-op after a final output)."""

    def fail(self, error: BaseException) -> None:
        """End the request with ``error``."""


class Outbox:
    """Answers gathered during one pass of the worker, grouped by loop.

    Not thread-safe: each pass (and the death path) uses its own outbox.
    """

    def __init__(self) -> None:
        self._batches: dict[Loop, list[_Callback]] = {}

    def post(self, loop: Loop, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)`` to run on ``loop`` at the next flush."""
        batch = self._batches.get(loop)
        if batch is None:
            batch = self._batches[loop] = []
        batch.append((fn, args))

    def pushes(self, loop: Loop) -> list[tuple[Sink, RequestOutput]]:
        """A list to fill with (sink, output) pairs, pushed in order at this point of the batch.

        A step's outputs go through it: one entry per loop instead of a bound
        method and an argument tuple per output.
        """
        pairs: list[tuple[Sink, RequestOutput]] = []
        self.post(loop, _push_all, pairs)
        return pairs

    def __bool__(self) -> bool:
        return bool(self._batches)

    def flush(self) -> list[Loop]:
        """Send each loop its batch in one call; return the loops that have ended.

        An ended loop (a closed asyncio loop, a finished trio run) gets nothing.
        """
        closed = [loop for loop, batch in self._batches.items() if not loop.post(_run_batch, batch)]
        self._batches = {}
        return closed


def _run_batch(batch: list[_Callback]) -> None:
    for fn, args in batch:
        try:
            fn(*args)
        except Exception as exc:
            # One failing delivery must not drop the rest of the batch.
            emit(logging.ERROR, "delivery failed", callback=repr(fn), exc_info=exc)


def _push_all(pairs: list[tuple[Sink, RequestOutput]]) -> None:
    for sink, out in pairs:
        try:
            sink.push(out)
        except Exception as exc:
            # One failing delivery must not drop the rest of the step's outputs.
            emit(logging.ERROR, "delivery failed", request_id=sink.request_id, exc_info=exc)


def _settle(future: Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


@dataclass(eq=False)
class Reply:
    """Where the answer to a command goes: a future on the loop that sent it."""

    loop: Loop
    future: Future[Any]

    @classmethod
    def here(cls) -> Reply:
        """Make a reply bound to the running loop (asyncio or trio)."""
        loop = current()
        return cls(loop, loop.futures()())

    def ok(self, outbox: Outbox, value: Any = None) -> None:
        outbox.post(self.loop, _settle, self.future, value, None)

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        outbox.post(self.loop, _settle, self.future, None, error)


@dataclass(eq=False)
class Add:
    """Add a request; its outputs and errors go to ``sink``.

    ``prepared``, where set, is the engine-core request being built off the
    worker (on vLLM's renderer pool) from the same prompt, params and
    ``kwargs``: the worker adds that once it is ``ready``, or builds the
    request itself where it can't be used (cancelled, or made for an engine
    that a restart replaced).
    """

    request_id: str
    prompt: Any
    params: SamplingParams
    kwargs: dict[str, Any]
    sink: Sink
    prepared: concurrent.futures.Future[Prepared] | None = None

    def ready(self) -> bool:
        """Whether the worker can add it without waiting for its input processing."""
        return self.prepared is None or self.prepared.done()

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        outbox.post(self.sink.loop, self.sink.fail, error)


@dataclass(eq=False)
class Abort:
    """Abort requests; ``reply`` (if any) is answered once they are out of the engine."""

    request_ids: list[str]
    reply: Reply | None = None
    why: str = "explicit"
    """Why, for the log: explicit, cancelled, disconnected or paused."""

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        if self.reply is not None:
            self.reply.fail(outbox, error)


@dataclass(eq=False)
class Call:
    """Run ``fn(llm_engine)`` between two steps and answer with its result."""

    fn: Callable[[LLMEngine], Any]
    reply: Reply

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        self.reply.fail(outbox, error)


@dataclass(eq=False)
class Hold:
    """Stop stepping at a boundary (now, or right after step ``at_step``) until released."""

    at_step: int | None
    reply: Reply
    caller_holds: frozenset[Hashable] = frozenset()
    """The holds of the caller's own ``paused()`` blocks (a contextvar's value)."""
    token: Hashable = field(default_factory=object)

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        self.reply.fail(outbox, error)


@dataclass(eq=False)
class Release:
    """End the hold made by the ``Hold`` with this token, applied or not."""

    token: Hashable

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        pass  # nobody waits for a release


@dataclass(eq=False)
class Pause:
    """Stop admitting requests, handling those in flight as ``mode`` says."""

    mode: PauseMode
    clear_cache: bool
    reply: Reply
    caller_holds: frozenset[Hashable] = frozenset()
    """The holds of the caller's own ``paused()`` blocks (a contextvar's value)."""

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        self.reply.fail(outbox, error)


@dataclass(eq=False)
class Resume:
    """Undo ``Pause``: admit the requests that waited, in order, and step again."""

    reply: Reply

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        self.reply.fail(outbox, error)


@dataclass(eq=False)
class Reset:
    """Reset the prefix cache between two steps; ``reply`` gets vLLM's answer."""

    running: bool
    """Preempt the running requests too (they recompute)."""
    connector: bool
    """Reset the KV connector's cache too."""
    reply: Reply

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        self.reply.fail(outbox, error)


@dataclass(eq=False)
class Restart:
    """Rebuild the engine on request and resume its unfinished requests there.

    Applied by the worker itself, not the applier: the commands queued after
    it are applied on the new engine. ``reply`` is answered once the new
    engine is served.
    """

    build: Callable[[], EngineLike] | None
    """Builds the new engine from other arguments, and every later rebuild too (None: the
    engine's own rebuild)."""
    reply: Reply

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        self.reply.fail(outbox, error)


Command = Add | Abort | Call | Hold | Release | Pause | Reset | Resume
"""What the loops' calls put in the inbox (``Restart`` too, which the worker applies itself)."""


def fail_all(commands: list[Command], error: BaseException) -> None:
    """Answer every command with ``error`` (from any thread)."""
    outbox = Outbox()
    for command in commands:
        command.fail(outbox, error)
    with contextlib.suppress(Exception):
        outbox.flush()
