"""The buffer between the worker and one stream's consumer.

Everything here runs on the event loop (asyncio loop or trio run) that
created the stream, except that the worker schedules ``_Sink.push``,
``aborting``, ``abort``, ``resumed`` and ``fail`` onto that loop with ``Loop.post``
(never calls them directly). So no lock is needed: the buffer is only ever
touched by its own loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.sampling_params import RequestOutputKind

from .._vllm import final_abort_output, merge_delta, with_completions
from ._metrics import Timeline
from ._pace import Pacer

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from vllm.outputs import CompletionOutput, RequestOutput

    from .._bridge._loops import Future, Loop

__all__ = ("_Sink",)


class _Sink:
    """The buffer between the worker and one stream's consumer.

    It holds at most one pending output, so a slow consumer costs constant
    memory however many steps pass: DELTA outputs are merged into the pending
    one, a CUMULATIVE or FINAL_ONLY output replaces it. With a stream
    interval (``pacer``) the pending output is also held back until the
    interval has passed since the last one went out (``_pace.py``). For ``n > 1`` it keeps
    the latest completion of each index, because vLLM's streaming kinds emit
    one child per output.
    """

    __slots__ = (
        "_error",
        "_last",
        "_latest",
        "_new_future",
        "_pending",
        "_waiter",
        "finished",
        "kind",
        "loop",
        "n",
        "native",
        "pacer",
        "request_id",
        "timeline",
    )

    def __init__(
        self,
        loop: Loop,
        request_id: str,
        kind: RequestOutputKind,
        n: int,
        interval: float = 0.0,
    ) -> None:
        self.loop = loop
        # The asyncio loop or trio token itself, held (the handle holds an
        # asyncio loop weakly) and compared once per output by the stream.
        self.native = loop.native
        # asyncio: the loop's own create_future, the cheapest wait it has.
        self._new_future: Callable[[], Future[None]] = loop.futures()
        self.request_id = request_id
        self.kind = kind
        self.n = n
        self.finished = False  # the final output or an error has been received
        self._last: RequestOutput | None = None
        self._pending: RequestOutput | None = None
        self._latest: dict[int, CompletionOutput] = {}
        self._error: BaseException | None = None
        self._waiter: Future[None] | None = None
        self.timeline = Timeline(request_id)
        # stream_interval: None (the common case) costs one test per output.
        self.pacer = Pacer(interval) if interval > 0 else None

    def push(self, out: RequestOutput) -> None:
        """Take one output from the engine (on the loop, scheduled by the worker)."""
        if self.finished:
            return
        if self.kind is RequestOutputKind.DELTA:
            if self._pending is None:
                self._pending = out
            else:
                # The pending output was never handed out, so merging into it is safe.
                merge_delta(self._pending, out)
        elif self.n > 1 and self.kind is RequestOutputKind.CUMULATIVE:
            for completion in out.outputs:
                self._latest[completion.index] = completion
            latest = [self._latest[i] for i in sorted(self._latest)]
            self._pending = with_completions(out, latest)
        else:
            self._pending = out
        self._last = out if self.kind is RequestOutputKind.DELTA else self._pending
        if out.finished:
            self.finished = True
        if self.pacer is None or self.pacer.arrived(out.finished):
            self._wake()
        # Bookkeeping last: whatever it raises, the consumer has its output.
        self.timeline.output(out, self.kind)
        if out.finished:
            self.timeline.finish(self._pending or out, self.kind)

    def resumed(self) -> None:
        """Note that the request lives on in a rebuilt engine (on the loop, from the worker)."""
        self.timeline.restarts += 1

    def aborting(self, why: str) -> None:
        """Note why the request is being aborted (on the loop, before its final output)."""
        self.timeline.abort_reason = why

    def abort(self) -> None:
        """End the stream with a final "abort" output, if the engine gave none.

        The engine's own abort output is preferred (it is exact); this is the
        fallback that keeps the promise that every request ends.
        """
        if self.finished:
            return
        delta = self.kind is RequestOutputKind.DELTA
        self.push(final_abort_output(self.request_id, self._last, self.n, delta))

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (on the loop, scheduled by the worker)."""
        if self.finished:
            return
        self.finished = True
        self._error = error
        if self.pacer is not None:
            self.pacer.release()
        self._wake()
        self.timeline.fail(error)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def take(self) -> RequestOutput | None:
        """Return the pending output, or None if there is none yet.

        Raises the stream's error, or StopAsyncIteration after the final output.
        """
        out = self._pending
        if out is not None and (self.pacer is None or self.pacer.due()):
            self._pending = None
            if self.n > 1 and self.kind is RequestOutputKind.DELTA:
                out.outputs.sort(key=_index)
            return out
        if out is not None:
            return None  # held for its interval
        if self._error is not None:
            raise self._error
        if self.finished:
            raise StopAsyncIteration
        return None

    def wait(self) -> Awaitable[None]:
        """What to await until ``push`` or ``fail`` is called, or a held output is due.

        Cancelling the wait raises the loop's cancellation exception there and
        leaves the buffer as it was: a later ``push`` is kept for the next wait.
        Without a held output it is the future itself, not a coroutine around
        it: the stream awaits one per output.
        """
        self._waiter = waiter = self._new_future()
        if self.pacer is not None and self.pacer.held:
            # Woken by the next push, or when the held output is due.
            return self.loop.wait(waiter, self.pacer.delay())
        return waiter

    @property
    def exhausted(self) -> bool:
        """Whether the consumer has taken everything, final output or error included."""
        return self.finished and self._pending is None and self._error is None


def _index(completion: CompletionOutput) -> int:
    return int(completion.index)
