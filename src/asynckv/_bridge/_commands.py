"""Commands from the loops to the worker, and the outbox that carries answers back.

Commands are built on an event loop (asyncio or trio) and applied on the
worker thread. Answers go back only through ``Outbox.flush``, which makes one
``Loop.post`` (``call_soon_threadsafe``, or trio's ``run_sync_soon``) per loop
per pass of the worker, however many requests and commands it answers: a step
with 200 streams on one loop costs that loop one wake-up.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .._log import emit
from .._types import PauseMode
from ._loops import current

if TYPE_CHECKING:
    from vllm import LLMEngine
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams

    from ._loops import Future, Loop

__all__ = (
    "Abort",
    "Add",
    "Call",
    "Command",
    "Hold",
    "Outbox",
    "Pause",
    "PauseMode",
    "Release",
    "Reply",
    "Reset",
    "Resume",
    "Sink",
    "fail_all",
)

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
    """Add a request; its outputs and errors go to ``sink``."""

    request_id: str
    prompt: Any
    params: SamplingParams
    kwargs: dict[str, Any]
    sink: Sink

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


Command = Add | Abort | Call | Hold | Release | Pause | Reset | Resume


def fail_all(commands: list[Command], error: BaseException) -> None:
    """Answer every command with ``error`` (from any thread)."""
    outbox = Outbox()
    for command in commands:
        command.fail(outbox, error)
    with contextlib.suppress(Exception):
        outbox.flush()
