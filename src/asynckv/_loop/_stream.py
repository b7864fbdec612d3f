"""RequestStream, and the rest of one request's loop side: its sink and its timings.

Everything here runs on the event loop (asyncio loop or trio run) that
created the stream. The worker reaches a stream only through its ``_Sink``:
it schedules ``_Sink.push``, ``aborting``, ``abort``, ``resumed`` and ``fail``
onto that loop with ``Loop.post`` and never calls them directly. So no lock
is needed: the buffer is only ever touched by its own loop.

One request's loop side, as trio's ``_channel.py`` keeps one state object
behind thin endpoints: ``_Sink`` is the state (the buffer the worker fills,
at most one pending output), ``RequestStream`` the reader's handle over it,
``Timeline`` the sink's record of the request's timings, which the stream
hands out as ``RequestMetrics``. Times are on the ``time.monotonic`` clock,
which vLLM's engine-core timestamps also use, so the engine's own figures are
taken where vLLM gives them (they need ``disable_log_stats=False``, vLLM's
default) and ours where it doesn't. A stream's time-based interval is
``_pace.py``'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from vllm.sampling_params import RequestOutputKind

from .._bridge._loops import running_asyncio_loop, task_of
from .._errors import EngineClosedError, EngineDeadError
from .._log import emit, enabled
from .._vllm import copy_delta, final_abort_output, merge_delta, request_stat, with_completions
from ._pace import Pacer

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from vllm.outputs import CompletionOutput, RequestOutput

    from .._bridge._loops import Future, Loop

__all__ = ("RequestMetrics", "RequestStream", "_Sink")


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings and counts of one finished request; times on the ``time.monotonic`` clock."""

    submitted: float
    """When ``generate()`` was called."""
    scheduled: float | None
    """When the engine first scheduled it (vLLM's timestamp), if known."""
    first_token: float | None
    """When its first token was produced (vLLM's timestamp, else when it reached the loop)."""
    last_token: float | None
    """When its last token was produced (as ``first_token``)."""
    finished: float
    """When its final output reached the stream."""
    prompt_tokens: int
    output_tokens: int
    """Generated tokens over all ``n`` completions."""
    n: int
    """Completions (the request's ``n``)."""
    preemptions: int | None
    """Times the engine preempted it (a prefix-cache reset of running requests counts).

    None when not known: vLLM's per-request stats are off (``disable_log_stats``)
    or this vLLM version does not count preemptions (0.26 doesn't).
    """
    finish_reason: str | None
    """The first completion's finish reason ("length", "stop", "abort", ...)."""
    restarts: int = 0
    """Restarts of a dead engine that the request lived through (``RestartPolicy``)."""

    @property
    def queue_time(self) -> float | None:
        """Seconds from submission to first scheduling, if known."""
        return None if self.scheduled is None else max(0.0, self.scheduled - self.submitted)

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token."""
        return None if self.first_token is None else max(0.0, self.first_token - self.submitted)

    @property
    def mean_itl(self) -> float | None:
        """Mean seconds between two tokens of one completion."""
        per_completion = self.output_tokens // max(1, self.n)
        if self.first_token is None or self.last_token is None or per_completion < 2:
            return None
        return (self.last_token - self.first_token) / (per_completion - 1)


class Timeline:
    """What one stream has seen, turned into ``RequestMetrics`` and log events."""

    __slots__ = (
        "_submitted",
        "abort_reason",
        "delta_tokens",
        "first_at",
        "metrics",
        "request_id",
        "restarts",
        "stats",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.first_at: float | None = None
        self.delta_tokens = 0
        self.stats: Any = None
        self.abort_reason: str | None = None
        self.metrics: RequestMetrics | None = None
        self.restarts = 0
        self._submitted = time.monotonic()

    def output(self, out: RequestOutput, kind: RequestOutputKind) -> None:
        """Note one output as it reaches the stream."""
        if out.metrics is not None:
            self.stats = out.metrics
        completions = out.outputs
        if kind is RequestOutputKind.DELTA:
            # Once per output on the loop: one completion (n == 1) needs no generator.
            if len(completions) == 1:
                self.delta_tokens += len(completions[0].token_ids)
            else:
                self.delta_tokens += sum(len(c.token_ids) for c in completions)
        if self.first_at is None and any(c.token_ids for c in completions):
            self.first_at = time.monotonic()
            if enabled(logging.DEBUG):
                ttft = round(self.first_at - self._submitted, 6)
                emit(logging.DEBUG, "first token", request_id=self.request_id, ttft=ttft)

    def finish(self, final: RequestOutput, kind: RequestOutputKind) -> None:
        """Make the metrics of a request whose final output arrived, and log it."""
        stats = self.stats
        now = time.monotonic()
        tokens = (
            self.delta_tokens
            if kind is RequestOutputKind.DELTA
            else sum(len(c.token_ids) for c in final.outputs)
        )
        first = request_stat(stats, "first_token_ts")
        last = request_stat(stats, "last_token_ts")
        preemptions = request_stat(stats, "num_preemptions")
        reason = final.outputs[0].finish_reason if final.outputs else None
        self.metrics = m = RequestMetrics(
            submitted=self._submitted,
            scheduled=request_stat(stats, "scheduled_ts"),
            first_token=first or self.first_at,
            last_token=last or (now if self.first_at is not None else None),
            finished=now,
            prompt_tokens=len(final.prompt_token_ids or ()),
            output_tokens=tokens,
            n=max(1, len(final.outputs)),
            preemptions=None if preemptions is None else int(preemptions),
            finish_reason=reason,
            restarts=self.restarts,
        )
        if not enabled(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "prompt_tokens": m.prompt_tokens,
            "output_tokens": m.output_tokens,
            "finish_reason": reason,
            "queue_time": _round(m.queue_time),
            "ttft": _round(m.ttft),
            "mean_itl": _round(m.mean_itl),
            "preemptions": m.preemptions,
        }
        if reason == "abort":
            emit(logging.INFO, "request aborted", why=self.abort_reason or "explicit", **fields)
        else:
            emit(logging.INFO, "request finished", **fields)

    def fail(self, error: BaseException) -> None:
        """Log a request that ended with an exception instead of a final output."""
        if isinstance(error, EngineClosedError):
            emit(logging.INFO, "request aborted", request_id=self.request_id, why="closed")
        elif isinstance(error, EngineDeadError):
            emit(logging.DEBUG, "request failed", request_id=self.request_id, error=str(error))
        else:
            emit(logging.INFO, "request rejected", request_id=self.request_id, error=str(error))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


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
            if self.n > 1:
                # Each output carries one child: the final "abort" one needs them all.
                for completion in out.outputs:
                    self._latest[completion.index] = completion
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
        last = self._last
        if delta and last is not None and self._latest:
            last = with_completions(last, list(self._latest.values()))
        self.push(final_abort_output(self.request_id, last, self.n, delta))

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


class RequestStream:
    """The outputs of one request, to iterate or to await, like ``AsyncLLM.generate``'s generator.

    A stream belongs to the event loop (asyncio loop or trio run) that
    created it: use it only there.
    It is its own async iterator (``aiter(stream) is stream``; ``anext(stream)``
    works): ``async for out in stream`` yields ``RequestOutput``s in the order
    the engine produced them, following ``sampling_params.output_kind``; the
    last one has ``finished=True``. ``await stream`` consumes what is left and
    returns the final output, with all ``n`` completions ordered by index
    (for DELTA, the merge of the deltas not consumed before), also after a
    partial iteration.

    The request is aborted in the engine before its next step on every path
    away from an unfinished stream: ``aclose()``; leaving
    ``async with engine.generate(...) as stream:`` by any exit (even a
    cancellation before the stream was first awaited); a cancellation of
    the wait for its next output (on trio, a cancel scope around that wait);
    on asyncio also cancelling the task that last took an output, wherever
    it waits then; and dropping the stream (so ``break`` out of
    ``async for out in engine.generate(...)`` aborts at once). A stream
    dropped before anything was taken from it also warns with
    ``ResourceWarning``: that is usually a forgotten ``await``.
    Every stream ends with a final output or an exception: ``EngineDeadError``,
    ``EngineClosedError`` or the engine's own error for a bad request.
    """

    __slots__ = (
        "__weakref__",
        "_abandoned",
        "_abort",
        "_final",
        "_on_done",
        "_sink",
        "_task",
        "_touched",
        "request_id",
    )

    def __init__(self, request_id: str, sink: _Sink, abort: Callable[[str, str], None]) -> None:
        self.request_id = request_id
        """The request's id in the engine, given or generated."""
        self._sink = sink
        self._abort = abort
        self._final: RequestOutput | None = None
        self._abandoned = False
        self._touched = False  # something was asked of it: iterated, awaited, closed
        # asyncio: the task that last took an output, watched so that its
        # cancellation (wherever it is waiting then) aborts the request. trio
        # has no per-task done callback; there a cancellation reaches the
        # stream through its wait, an `async with` block, or the dropped stream.
        self._task: asyncio.Task[Any] | None = None
        self._on_done: Callable[[asyncio.Task[Any]], None] | None = None

    @property
    def finished(self) -> bool:
        """Whether the engine is done with this request (final output or error received)."""
        return self._sink.finished

    @property
    def metrics(self) -> RequestMetrics | None:
        """Timings and counts of the request, once its final output has arrived."""
        return self._sink.timeline.metrics

    def _check_loop(self) -> None:
        if running_asyncio_loop() is not self._sink.native and not self._sink.loop.is_current():
            raise self._wrong_loop()

    def _wrong_loop(self) -> RuntimeError:
        return RuntimeError(
            f"stream {self.request_id!r} belongs to another event loop; "
            "use it only on the loop that called generate()"
        )

    async def _next(self) -> RequestOutput:
        # The hot path: one coroutine per output, no future when one is pending;
        # on asyncio one C call checks the loop.
        sink = self._sink
        native = sink.native
        if running_asyncio_loop() is native:
            task = task_of(native)  # type: ignore[arg-type]  # native is this asyncio loop
            if task is not self._task:
                self._watch(task)
        elif not sink.loop.is_current():
            raise self._wrong_loop()
        self._touched = True
        try:
            while (out := sink.take()) is None:
                try:
                    await sink.wait()
                except BaseException:
                    # Cancelled (or interrupted) while waiting: nobody wants the rest.
                    self._abandon("cancelled")
                    raise
        except BaseException:
            if sink.finished:
                # Ended by an error: stop watching the task, or a long-lived task
                # that meets many failed streams would collect their callbacks.
                self._watch(None)
            raise
        if out.finished:
            self._final = out
            self._watch(None)
        return out

    def _watch(self, task: asyncio.Task[Any] | None) -> None:
        if self._task is not None and self._on_done is not None:
            self._task.remove_done_callback(self._on_done)
        self._task, self._on_done = task, None
        if task is not None:
            # The task holds only a weak reference, so dropping the stream still aborts.
            self._on_done = functools.partial(_abandon_if_cancelled, weakref.ref(self))
            task.add_done_callback(self._on_done)

    def _abandon(self, why: str) -> None:
        if not self._sink.finished and not self._abandoned:
            self._abandoned = True
            self._abort(self.request_id, why)

    def __aiter__(self) -> RequestStream:
        return self

    def __anext__(self) -> Coroutine[Any, Any, RequestOutput]:
        """The next output; ``StopAsyncIteration`` after the final one."""
        return self._next()

    def __await__(self) -> Generator[object, None, RequestOutput]:
        return self._result().__await__()

    async def _result(self) -> RequestOutput:
        merged: RequestOutput | None = None
        delta = self._sink.kind is RequestOutputKind.DELTA
        while not self._sink.exhausted:
            out = await self._next()
            if delta and merged is not None:
                merge_delta(merged, out)
            elif delta:
                merged = copy_delta(out)
            else:
                merged = out
        if merged is None:
            if self._final is None:
                raise RuntimeError(f"stream {self.request_id!r} was already consumed")
            return self._final
        if delta:
            merged.outputs.sort(key=_index)
        return merged

    async def aclose(self) -> None:
        """Abort the request if it is unfinished and wait until its stream has ended.

        Idempotent. Errors that end the stream (a dead engine, say) are not raised.
        """
        self._check_loop()
        self._touched = True
        self._abandon("disconnected")
        sink = self._sink
        while True:
            try:
                if sink.take() is None:
                    await sink.wait()
            except (StopAsyncIteration, Exception):
                return

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, _: object, exc: BaseException | None, __: object) -> None:
        """Leaving the block, by any exit, aborts the request if it is unfinished.

        It doesn't wait for the abort (a cancellation must not wait on the
        engine): the request is out of the engine before its next step.
        """
        self._touched = True
        self._abandon("cancelled" if _cancelling(exc) else "disconnected")

    def __del__(self) -> None:
        if self._sink.finished or self._abandoned:
            return
        self._abort(self.request_id, "disconnected")
        if not self._touched:
            warnings.warn(
                f"RequestStream {self.request_id!r} was garbage-collected unfinished "
                "before anything was taken from it; its request was aborted",
                ResourceWarning,
                stacklevel=1,
            )


def _abandon_if_cancelled(stream: weakref.ref[RequestStream], task: asyncio.Task[Any]) -> None:
    # A done callback of the task that last took an output (on the stream's loop).
    alive = stream()
    if alive is not None and task.cancelled():
        alive._abandon("cancelled")


def _cancelling(exc: BaseException | None) -> bool:
    # For the log's "why" only: trio's Cancelled or asyncio's CancelledError
    # leaving the block, or (asyncio) a cancellation pending on the task.
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return True
    task = asyncio.current_task() if running_asyncio_loop() is not None else None
    return task is not None and task.cancelling() > 0
