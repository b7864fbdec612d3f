"""AsyncEngine: the event-loop side of the facade.

Every method here runs on the caller's thread, usually an event loop
(asyncio or trio), and never touches the ``LLMEngine``: it puts a command in
the worker's inbox and, for the awaitable ones, waits for the answer on the
caller's loop. The sync ``shutdown()`` may run on any thread; ``stats``,
``check_health`` and the state properties read the worker's counters and
state, from any thread, without waiting for it. The ``AsyncLLM`` calls that are only
``run_on_engine``, and the build-time properties, are in ``_asyncllm.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, get_args

import anyio
from vllm.sampling_params import SamplingParams
from vllm.usage.usage_lib import UsageContext

from .._bridge import _loops
from .._bridge._channel import (
    Abort,
    Add,
    Call,
    Hold,
    Pause,
    Release,
    Reply,
    Reset,
    Restart,
    Resume,
)
from .._errors import (
    EngineClosedError,
    EngineDeadError,
    EngineNotStartedError,
    EngineRestartingError,
    EngineStalledError,
)
from .._stats import EngineStats
from .._types import PauseMode, RestartPolicy
from .._vllm import input_executor, prepare_request
from .._worker._worker import Worker
from ._asyncllm import AsyncLLMMethods, BuildRecord
from ._inputs import StreamingInputs, checked_streaming_params, is_streaming_input
from ._requests import RequestArgs, engine_options, pump
from ._steps import StepStream
from ._stream import RequestStream, _Sink

if TYPE_CHECKING:
    from types import TracebackType

    from vllm import EngineArgs, LLMEngine
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.output_processor import RequestOutputCollector
    from vllm.v1.metrics.loggers import StatLoggerFactory

    from .._vllm import BuildTime, EngineLike, Prepared

__all__ = (
    "AsyncEngine",
    "checked_pause_mode",
    "checked_request_id",
    "checked_request_ids",
    "checked_restart",
    "checked_sampling_params",
    "checked_stream_interval",
)

R = TypeVar("R")

# The holds of the paused() blocks the current task is inside (tasks created
# in a block inherit it): a call that needs steps which such a hold stops can
# never complete, and the worker refuses it at once.
_HOLDING: contextvars.ContextVar[frozenset[Hashable]] = contextvars.ContextVar(
    "asynckv_holding", default=frozenset()
)


class AsyncEngine(AsyncLLMMethods):
    """An async facade (asyncio or trio) over one ``vllm.LLMEngine``, stepped on its own thread.

    A dedicated worker thread owns the engine: it is the only thread that
    calls it. Methods put commands in the worker's inbox, which it applies in
    FIFO order between two steps, so a command issued after another (from any
    loop or thread) is applied after it. Streams and command results are
    delivered to the event loop that issued them; one started engine serves
    any number of loops, asyncio loops and trio runs alike, at once or one
    after the other.

    Build one with ``AsyncEngine.from_engine_args(args)`` and ``await start()``
    (or ``async with``), or wrap an engine you built with ``AsyncEngine(engine)``,
    which starts the worker at once. The engine is then owned by the facade:
    closing the facade shuts it down.

    ``freeze_gc`` (default True): once the engine is built, run a full garbage
    collection and ``gc.freeze()``, as vLLM's own OpenAI server does. What
    exists then (torch, vLLM, the engine's client side) lives as long as the
    process; frozen, it is no longer scanned by every full collection, which
    otherwise holds the GIL, and so stalls the event loop, for a long time
    (measured: 0.25 s on CPU and 0.5 s on an H200 host in a burst of 1,024
    requests; docs/performance.md). Process-wide, like every ``gc`` setting:
    pass False to leave the collector alone.

    ``stream_interval`` (seconds, default 0): the default of ``generate``'s
    own, which makes a stream wake its consumer at most once per interval.

    ``keep_off_model_cores`` (default True): where the engine's model workers
    are bound to some of this process's CPUs (vLLM's CPU backend), keep the
    worker thread and vLLM's output thread on the others, which vLLM reserves
    for the frontend, while 16 or more requests are in flight (and until 4
    or fewer are), so that they don't preempt a long model step. The caller's
    event loop is never moved; on a GPU nothing is bound and nothing moves.
    Threads and processes started from the worker thread meanwhile (a
    ``run_on_engine`` callable's) inherit the placement. docs/performance.md
    has the figures.

    ``rebuild`` (a wrapped engine only): a callable that builds a new engine
    after this one died; with it, ``restart`` (default ``RestartPolicy()``)
    says how often. ``from_engine_args(..., restart=...)`` rebuilds from the
    same arguments. Without either, a death is final, as it always was.

    It also has ``AsyncLLM``'s names and shapes for what the two share
    (``get_tokenizer``, ``tokenizer``, ``add_request``, ``sleep``, LoRA, profiling,
    the cache resets, ...), so code written for ``AsyncLLM`` runs on it; and
    ``asynckv.AsyncEngineClient`` makes it vLLM's ``EngineClient``.

    The calls it shares with ``AsyncLLM`` that are only ``run_on_engine``, and
    the build-time properties, come from ``AsyncLLMMethods``.
    """

    def __init__(
        self,
        llm_engine: EngineLike,
        *,
        freeze_gc: bool = True,
        stream_interval: float = 0.0,
        rebuild: Callable[[], EngineLike] | None = None,
        restart: RestartPolicy | None = None,
        keep_off_model_cores: bool = True,
    ) -> None:
        if restart is not None and rebuild is None:
            raise ValueError("restart needs rebuild=: a wrapped engine can't be rebuilt without it")
        if rebuild is not None and restart is None:
            restart = RestartPolicy()
        self._record = BuildRecord(llm_engine)
        self._worker = Worker(
            lambda: llm_engine, freeze_gc, checked_restart(restart), rebuild, keep_off_model_cores
        )
        self._closed = False
        self._fault_refused: tuple[str, str] | None = None
        self._stream_interval = checked_stream_interval(stream_interval)
        self._args: _Rebuildable | None = None
        self._worker.start(None)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        start_engine_loop: bool = True,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        stat_loggers: list[StatLoggerFactory] | None = None,
        *,
        freeze_gc: bool = True,
        stream_interval: float = 0.0,
        restart: RestartPolicy | None = None,
        keep_off_model_cores: bool = True,
    ) -> AsyncEngine:
        """Make an engine that ``start()`` will build from ``engine_args``.

        Does no heavy work: nothing is loaded until ``start()`` (``AsyncLLM``
        builds in its constructor). ``usage_context`` and ``stat_loggers`` go
        to ``LLMEngine.from_engine_args``; ``start_engine_loop`` is accepted for
        ``AsyncLLM``'s signature and, as there, changes nothing. ``freeze_gc``,
        ``stream_interval`` and ``keep_off_model_cores``: see the class.

        ``restart`` (default None: a death is final): rebuild a dead engine from
        the same arguments and resume every unfinished request where it
        stopped, within the policy's limits (``RestartPolicy``;
        docs/reliability.md, "Restart and resume").
        """
        args = _Rebuildable(engine_args, usage_context, stat_loggers)
        self = cls._unstarted(args.build, freeze_gc, stream_interval, restart, keep_off_model_cores)
        self._args = args
        return self

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: VllmConfig,
        start_engine_loop: bool = True,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        stat_loggers: list[StatLoggerFactory] | None = None,
        enable_log_requests: bool = False,
        aggregate_engine_logging: bool = False,
        disable_log_stats: bool = False,
        client_addresses: dict[str, Any] | None = None,
        client_count: int = 1,
        client_index: int = 0,
        *,
        freeze_gc: bool = True,
        stream_interval: float = 0.0,
        restart: RestartPolicy | None = None,
        keep_off_model_cores: bool = True,
    ) -> AsyncEngine:
        """Make an engine that ``start()`` will build from ``vllm_config``, as ``AsyncLLM``'s.

        The engine is built on the worker thread by ``start()``, in vLLM's
        multiprocess mode unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, with
        stats on unless ``disable_log_stats`` (they feed vLLM's stat loggers:
        its log line, its Prometheus metrics and any ``stat_loggers``).
        ``enable_log_requests`` changes nothing: asynckv logs every request at
        DEBUG through its own logger (``configure_logging``).
        ``start_engine_loop``, ``freeze_gc``, ``stream_interval``, ``restart``
        and ``keep_off_model_cores``: as in ``from_engine_args`` (``restart``
        rebuilds from the same configuration).

        Raises:
            NotImplementedError: ``client_addresses``, ``client_count`` or
                ``client_index`` given: an engine started elsewhere, which
                ``LLMEngine`` can't attach to.
        """
        if client_addresses or client_count != 1 or client_index != 0:
            raise NotImplementedError(
                "asynckv builds its own engine: client_addresses, client_count and "
                "client_index (an engine launched elsewhere) are not supported"
            )

        def build() -> LLMEngine:
            import vllm.envs as envs
            from vllm import LLMEngine
            from vllm.v1.executor import Executor

            return LLMEngine(
                vllm_config=vllm_config,
                executor_class=Executor.get_class(vllm_config),
                log_stats=not disable_log_stats,
                aggregate_engine_logging=aggregate_engine_logging,
                usage_context=usage_context,
                stat_loggers=stat_loggers,
                multiprocess_mode=envs.VLLM_ENABLE_V1_MULTIPROCESSING,
            )

        return cls._unstarted(build, freeze_gc, stream_interval, restart, keep_off_model_cores)

    @classmethod
    def _unstarted(
        cls,
        build: Callable[[], LLMEngine],
        freeze_gc: bool,
        stream_interval: float = 0.0,
        restart: RestartPolicy | None = None,
        keep_off_model_cores: bool = True,
    ) -> AsyncEngine:
        self = cls.__new__(cls)
        self._record = BuildRecord()
        # A rebuilt engine is not recorded: the loop reads the first one's configs
        # and renderer, which a rebuild from the same arguments leaves as they were.
        policy = checked_restart(restart)
        self._worker = Worker(
            self._record.wrap(build), freeze_gc, policy, build, keep_off_model_cores
        )
        self._closed = False
        self._fault_refused = None
        self._stream_interval = checked_stream_interval(stream_interval)
        self._args = None
        return self

    @property
    def stream_interval(self) -> float:
        """The default of ``generate(stream_interval=...)``, seconds (0: every output at once).

        Settable; a new value applies to streams made after it, and is checked
        as ``generate``'s own (TypeError, ValueError).
        """
        return self._stream_interval

    @stream_interval.setter
    def stream_interval(self, seconds: float) -> None:
        self._stream_interval = checked_stream_interval(seconds)

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine on the worker thread and wait until it is ready.

        The event loop keeps serving meanwhile (loading and compiling can take
        tens of seconds). Raises the engine's own error if it can't be built.
        A no-op for an engine that is already started.
        """
        self._check_open()
        if self._worker.started:
            return
        reply = Reply.here()
        self._worker.start(reply)
        await reply.future

    async def aclose(self, timeout: float = 30.0, *, drain: float = 0.0) -> None:
        """Close the engine: end what is in flight, shut vLLM down, join the worker.

        Streams and commands still in flight end with ``EngineClosedError``, as
        do all later calls. Waits (without blocking the loop) up to about
        ``timeout`` seconds for the worker; a worker stuck in a dead engine is
        abandoned and its engine processes killed. Idempotent.

        ``drain`` (seconds, vLLM's ``--shutdown-timeout``): first let the
        requests already admitted finish, for up to that long, while every new
        one ends at once with ``EngineClosedError`` (its ``draining`` set);
        then close as above. 0 ends what is in flight at once. Without a drain
        the engine is closed in well under a second: vLLM's engine-core
        processes are stopped as ``vllm serve`` stops them.

        A cancellation never stops a close that has begun. Under a trio (or
        anyio) cancel scope the wait is shielded: leaving ``async with engine:``
        by a cancellation returns once the engine is closed, where trio's
        cancelled scope would otherwise cancel the cleanup itself. asyncio's
        ``task.cancel()`` interrupts the wait, as it always did, and the close
        goes on in its thread.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._worker.close, timeout, checked_drain(drain))

    def shutdown(self, timeout: float | None = None, *, drain: float = 0.0) -> None:
        """Blocking ``aclose()``, for any thread; idempotent.

        ``timeout`` and ``drain`` as in ``aclose()``; a ``timeout`` of None
        (``AsyncLLM``'s default, which waits without limit there) waits up to
        30 seconds, so that a worker stuck in a dead engine can't hang the caller.
        """
        if self._closed:
            return
        self._closed = True
        self._worker.close(30.0 if timeout is None else timeout, checked_drain(drain))

    async def restart(self, **overrides: Any) -> None:
        """Rebuild the engine on purpose and resume every unfinished request on the new one.

        A planned restart, for a configuration change or a fresh engine: the
        worker applies it between two steps, in FIFO order with every other
        command. It reads each unfinished request's state, shuts the engine
        down, builds a new one from the same arguments, or from them with
        ``overrides`` (``EngineArgs`` fields, kept for every later rebuild),
        and re-adds each request as its continuation from its last token,
        exactly as the ``RestartPolicy`` resumes them after a death (the same
        splice; greedy requests continue with the tokens they would have had
        where the computation is deterministic). Callers see a pause, not an
        error: their streams stop while the engine is rebuilt, then go on
        (``RequestStream.metrics.restarts`` counts it); a request whose
        parameters can't be resumed ends with ``RequestNotResumedError``
        (docs/reliability.md). Requests and commands sent meanwhile wait in
        the inbox and reach the new engine. It is not a death: the policy
        doesn't count it, but ``stats().restarts`` does, and ``restarting``
        is true (``check_health`` raises ``EngineRestartingError``) until
        the new engine serves.

        Returns once the new engine serves and the requests are re-added.
        Cancelling the wait doesn't stop the restart. A rebuild that fails
        ends the engine as a failed restart after a death does: every stream
        and this call get ``EngineDeadError``.

        Needs a ``RestartPolicy`` (``restart=`` when the engine is made): only
        then do requests keep the state they resume from.
        ``RestartPolicy(max_restarts=0)`` keeps every death final.

        Raises:
            ValueError: the engine has no ``RestartPolicy``.
            TypeError: ``overrides`` given for an engine not made by
                ``from_engine_args``, or one that is no ``EngineArgs`` field.
            EngineClosedError, EngineNotStartedError, EngineDeadError: at once.
        """
        self._check_open()
        if not self._worker.started:
            raise EngineNotStartedError()
        if not self._worker.resumable:
            raise ValueError(
                "restart() needs a RestartPolicy (restart= when the engine is made): "
                "without one, requests keep no state to resume from"
            )
        build: Callable[[], EngineLike] | None = None
        if overrides:
            if self._args is None:
                raise TypeError(
                    "restart(**overrides) needs an engine made by from_engine_args: "
                    "this one has no EngineArgs to override"
                )
            self._args = self._args.replaced(overrides)
            build = self._args.build
        await self._ask(lambda reply: Restart(build, reply))

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(draining=self._worker.draining)

    def _submit(self, command: Any) -> None:
        self._check_open()
        if not self._worker.started:
            raise EngineNotStartedError()
        self._worker.inbox.put(command)  # raises EngineDeadError once dead

    async def _ask(self, make: Callable[[Reply], Any]) -> Any:
        reply = Reply.here()
        self._submit(make(reply))
        return await reply.future

    # -- state -------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """Whether the engine is started and neither closed nor dead (``errored``)."""
        return self._worker.started and not self._closed and not self.errored

    @property
    def is_stopped(self) -> bool:
        """Whether the engine was closed or has died.

        ``AsyncLLM.is_stopped`` is ``errored``; here a closed engine is
        stopped too, and ``errored`` stays False for it.
        """
        return self._closed or self.errored

    def _build_time(self) -> BuildTime:
        built = self._record.built
        if built is None:
            if self._closed or self.errored:
                raise EngineClosedError()  # it never got built
            if self._worker.started:
                raise AttributeError(
                    "the wrapped engine has no vllm_config, renderer or input_processor"
                )
            raise EngineNotStartedError()
        return built

    # -- requests ------------------------------------------------------------------

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stream_interval: float | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Submit a request now and return its stream.

        The request is in the inbox when this returns, before anyone awaits
        the stream. ``prompt`` is anything ``LLMEngine.add_request`` takes (a
        string, a ``TokensPrompt``, ...). ``kwargs`` are ``AsyncLLM.generate``'s
        request arguments (``lora_request``, ``priority``, ``session_id``,
        ``kv_hints``, ``reasoning_ended``, ...), with its meaning; they are
        checked here, at once: ``data_parallel_rank`` may only be 0 or None
        (one engine core; any other raises ``AsyncLLM``'s
        ``VLLMValidationError``), and the reasoning fields, which
        ``LLMEngine.add_request`` lacks, are set on the engine request that
        vLLM's input processor builds. That build (tokenization, validation)
        starts here on vLLM's renderer thread pool, as on ``AsyncLLM``, not on
        the worker, which only adds the built request between two steps, in
        the order of submission (a multimodal model's inputs are still
        processed on the worker, in order). Without ``request_id`` a
        unique one is made. Must be called on a running event loop (asyncio or trio),
        which the stream then belongs to.

        A bad request (empty or too long prompt, unknown LoRA, an id already
        in flight, ...) raises its error from the stream, to this caller only.

        ``stream_interval`` (seconds; None: the engine's ``stream_interval``)
        makes the stream wake its consumer at most once per interval: outputs
        that come sooner are coalesced on the loop (DELTA outputs merged,
        CUMULATIVE ones replaced by the latest), and go out together once the
        interval has passed. The first output and the final one always go out
        at once, and no token is lost. 0 hands out every output as it comes.

        Raises:
            TypeError: ``sampling_params``, ``request_id``, ``stream_interval``
                or a request argument has the wrong type, or ``kwargs`` has a
                name ``AsyncLLM.generate`` doesn't take.
            ValueError: a ``seed`` beyond 64 bits (vLLM would hang on it), a
                negative ``stream_interval``.
            VLLMValidationError: a ``data_parallel_rank`` other than 0.
            EngineClosedError, EngineDeadError, EngineNotStartedError: at once.
        """
        loop = _loops.current()
        params = checked_sampling_params(sampling_params)
        rid = checked_request_id(request_id)
        interval = (
            self._stream_interval
            if stream_interval is None
            else checked_stream_interval(stream_interval)
        )
        args = RequestArgs.from_options(kwargs)
        if is_streaming_input(prompt):
            stream, _ = self._stream_inputs(prompt, params, rid, args, interval)
            return stream
        sink = _Sink(loop, rid, params.output_kind, params.n, interval)
        options = args.add_request_options()
        prepared = self._prepare(rid, prompt, params, options)
        self._submit(Add(rid, prompt, params, options, sink, prepared))
        return RequestStream(rid, sink, self._abort_soon)

    def _prepare(
        self, request_id: str, prompt: Any, params: SamplingParams, options: dict[str, Any]
    ) -> concurrent.futures.Future[Prepared] | None:
        # The request's input processing (tokenization, validation, the core
        # request), started now on vLLM's renderer pool, as AsyncLLM runs it:
        # the worker then only adds what was built, and steps meanwhile. None
        # where the worker must process it (no engine built yet, a fake, a
        # multimodal model, a pool shut down by a close or a rebuild).
        built = self._record.built
        executor = None if built is None else input_executor(built)
        if built is None or executor is None:
            return None
        try:
            return executor.submit(prepare_request, built, request_id, prompt, params, options)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            return None

    def _stream_inputs(
        self,
        inputs: Any,
        params: SamplingParams,
        request_id: str,
        args: RequestArgs,
        interval: float,
    ) -> tuple[RequestStream, StreamingInputs]:
        # A streaming input (_inputs.py): the stream, and the task that feeds it.
        if args.reasoning_ended is not None or args.reasoning_parser_kwargs is not None:
            raise NotImplementedError(
                "reasoning_ended and reasoning_parser_kwargs don't go with a streaming "
                "input (as on AsyncLLM)"
            )
        params = checked_streaming_params(params)
        loop = _loops.current()
        if _loops.running_asyncio_loop() is None:
            raise NotImplementedError("a streaming input is read on asyncio only")
        self._check_open()
        if not self._worker.started:
            raise EngineNotStartedError()
        if (error := self._worker.inbox.error) is not None:
            raise error  # dead: as a submit would raise
        sink = _Sink(loop, request_id, params.output_kind, params.n, interval)

        def submit(prompt: Any, first: SamplingParams, options: dict[str, Any]) -> None:
            self._submit(Add(request_id, prompt, first, options, sink))

        feeder = StreamingInputs(
            self,
            request_id,
            inputs,
            params,
            args.add_request_options(),
            sink,
            submit,
            lambda why: self._abort_soon(request_id, why),
        )

        def abandon(rid: str, why: str) -> None:
            feeder.cancel()
            self._abort_soon(rid, why)

        return RequestStream(request_id, sink, abandon), feeder

    def _abort_soon(self, request_id: str, why: str) -> None:
        # Called from streams abandoned by cancel, break or GC: never raise. A request
        # that a pool member adopted (failover) is aborted there.
        inbox = self._worker.forwarded.get(request_id, self._worker.inbox)
        with contextlib.suppress(Exception):
            inbox.put(Abort([request_id], None, why))

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests and return once they are out of the engine.

        Each stream ends with a final output whose unfinished completions have
        ``finish_reason == "abort"``. Unknown or finished ids are ignored.
        ``internal`` is ``AsyncLLM``'s flag for ids that vLLM made itself; asynckv
        hands out only the ids given to ``generate``, so both values abort them.
        """
        ids = checked_request_ids(request_id)
        await self._ask(lambda reply: Abort(ids, reply))

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        prompt_text: str | None = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
        kv_hints: Any = None,
    ) -> RequestOutputCollector:
        """Add a request and return vLLM's ``RequestOutputCollector`` of its outputs.

        As ``AsyncLLM.add_request``: ``await collector.get()`` (or
        ``get_nowait()``) returns the next output, DELTA outputs merged while
        nobody reads; the request runs until it finishes or is aborted with
        ``abort(request_id)``: dropping the collector does not abort it. A bad
        request raises from ``get()``. A task on this loop moves the outputs
        from the request's stream into the collector. asynckv's own
        ``generate()`` returns that stream directly, which aborts when dropped.

        Raises:
            NotImplementedError: ``prompt`` is an async generator (streaming
                input), which ``LLMEngine`` does not take.
        """
        from vllm.v1.engine.output_processor import RequestOutputCollector

        args = RequestArgs(
            arrival_time=arrival_time,
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
            trace_headers=trace_headers,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            session_id=session_id,
            prompt_text=prompt_text,
            reasoning_ended=reasoning_ended,
            reasoning_parser_kwargs=reasoning_parser_kwargs,
            kv_hints=kv_hints,
        )
        options = await engine_options(self, args)
        collector = RequestOutputCollector(params.output_kind, request_id)
        pump(self.generate(prompt, params, request_id, **options), collector)
        return collector

    # -- controls ---------------------------------------------------------------------

    async def run_on_engine(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``fn(llm_engine, *args, **kwargs)`` on the worker between two steps.

        Returns its result; its exception is raised here and the engine keeps
        going. ``fn`` must not block for long: no step runs meanwhile.
        """
        result: R = await self._ask(lambda reply: Call(lambda e: fn(e, *args, **kwargs), reply))
        return result

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Reset the prefix cache between two steps and return vLLM's answer.

        False when running requests still hold blocks and
        ``reset_running_requests`` is False. With it True, running requests are
        preempted and recomputed, and finish as they would have without the reset.
        """
        running, connector = reset_running_requests, reset_connector
        result: bool = await self._ask(lambda reply: Reset(running, connector, reply))
        return result

    def steps(self, buffer: int = 1024) -> StepStream:
        """Stream a ``StepRecord`` for each engine step from now on: ``async for step in ...``.

        Call it on the loop that will read it. Records come in step order,
        with the step's number, duration, requests and tokens (prefill and
        decode apart), finishes, and preemptions and the scheduler's queue
        where vLLM reports them (stats on). A reader that falls behind loses
        the oldest records beyond ``buffer`` (``StepStream.skipped`` counts
        them); the worker never waits for it. With no reader the worker
        makes no records at all. Iteration stops when the stream is closed or
        the engine closes; it raises ``EngineDeadError`` if the engine dies.
        ``run_on_engine`` remains the way to run code between two steps.

        Raises:
            ValueError: ``buffer`` < 1.
            EngineClosedError: the engine is closed.
        """
        self._check_open()
        if buffer < 1:
            raise ValueError(f"buffer must be at least 1, got {buffer}")
        return StepStream(self._worker.steps, buffer)

    def stats(self) -> EngineStats:
        """Take a snapshot of the engine's counters, without waiting for the worker.

        Safe from any thread; never blocks. See ``EngineStats`` for the fields.
        """
        return self._worker.stats()

    @property
    def step_count(self) -> int:
        """The number of engine steps completed so far."""
        return self._worker.counters.steps

    @contextlib.asynccontextmanager
    async def paused(self, at_step: int | None = None) -> AsyncIterator[int]:
        """Hold the engine at a step boundary for the duration of the block.

        Enters once the worker stands at the next boundary, or right after step
        ``at_step`` completes, and yields the number of completed steps there.
        Commands issued in the block (generate, abort, reset, ...) are applied
        in order at that boundary; stepping resumes when the block exits.

        Holds stack: stepping resumes when every block has exited. A block
        entered inside another of the same task (or of a task created inside
        it) for a future ``at_step`` could never be entered, and raises at once.

        Raises:
            ValueError: ``at_step`` has already passed.
            EngineHeldError: ``at_step`` is in the future and the caller's own
                ``paused()`` block stops the stepping.
        """
        holding = _HOLDING.get()
        hold = Hold(at_step, Reply.here(), holding)
        try:
            self._submit(hold)
            step: int = await hold.reply.future
            entered = _HOLDING.set(holding | {hold.token})
            try:
                yield step
            finally:
                _HOLDING.reset(entered)
        finally:
            with contextlib.suppress(EngineClosedError, EngineDeadError):
                self._worker.inbox.put(Release(hold.token))

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """Pause generation, as ``AsyncLLM.pause_generation`` does.

        Requests submitted while paused wait and are admitted, in order, on
        ``resume_generation()``. ``mode`` says what happens to those in flight:
        ``"abort"`` aborts them, ``"wait"`` returns once they have finished,
        ``"keep"`` freezes them until resumed. ``clear_cache`` then resets the
        prefix cache (preempting kept requests, which recompute on resume).
        A pause while paused applies its own mode to what is in flight. A
        pending ``"wait"`` also returns when ``resume_generation()`` comes first.
        docs/reset-and-pause.md has the outcome of every combination.

        Raises:
            ValueError: an unknown ``mode``.
            EngineHeldError: ``"wait"`` with requests in flight while a ``"keep"``
                pause or the caller's own ``paused()`` block stops the stepping
                (it could never return); nothing changes.
        """
        mode = checked_pause_mode(mode)
        holding = _HOLDING.get()
        await self._ask(lambda reply: Pause(mode, clear_cache, reply, holding))

    async def resume_generation(self) -> None:
        """Resume after ``pause_generation()``: admit the waiting requests, step again.

        A no-op when not paused. Pending ``"wait"`` pauses return.
        """
        await self._ask(Resume)

    async def is_paused(self) -> bool:
        """Whether ``pause_generation()`` is in force."""
        self._check_open()
        return self._worker.admission_paused

    # -- health ----------------------------------------------------------------------

    async def check_health(self, stall_timeout: float | None = None) -> None:
        """Raise unless the engine is usable and, given ``stall_timeout``, making progress.

        Never waits for the worker, so it answers even while a step hangs.

        As ``AsyncLLM.check_health``, it raises ``dead_error`` whenever
        ``errored`` is true, before anything else is read.

        Raises:
            EngineClosedError: the engine was closed.
            EngineDeadError: the engine died (with a ``RestartPolicy``: beyond
                it), that is ``errored`` is true; vLLM's ``EngineDeadError`` too.
            EngineRestartingError: a dead engine is being rebuilt (its
                ``RestartPolicy``), or a planned ``restart()`` rebuilds it:
                degraded, not dead; requests wait and resume.
            EngineStalledError: a ``step()`` has been running for longer than
                ``stall_timeout`` seconds, or requests are unfinished, nothing
                holds the engine (``paused()``, a "keep" pause) and no step has
                completed for that long.
        """
        self._check_open()
        if self.errored:
            raise self.dead_error
        snap = self._worker.health()
        if (error := snap.dead_error) is not None:  # it died since errored was read
            raise error
        if snap.restarting:
            raise EngineRestartingError(snap.restart_cause)
        if stall_timeout is None:
            return
        now = time.perf_counter()
        stepping = snap.in_step_since
        if stepping is not None and now - stepping > stall_timeout:
            # A step that doesn't return stalls everything, whatever we track.
            raise EngineStalledError(now - stepping, snap.in_flight)
        if not snap.in_flight or snap.held:
            return
        idle = now - max(snap.last_step_end or 0.0, snap.busy_since)
        if idle > stall_timeout:
            raise EngineStalledError(idle, snap.in_flight)

    async def get_status(self) -> dict[str, Any]:
        """The engine's fault-tolerance status, in ``AsyncLLM.get_status``'s shape.

        ``{"schema_version": 1, "total_engines": 1, "engines": [entry]}``, the
        entry ``{"id": 0, "status": ...}`` read from asynckv's lifecycle, without
        waiting for the worker (any thread's loop; it answers while a step
        hangs): ``"healthy"`` while running, ``"unhealthy"`` while a dead
        engine is rebuilt under its ``RestartPolicy`` (with ``"fault_info"``,
        the death's exception type, as vLLM gives it), ``"dead"`` once it died
        for good. After a ``handle_fault`` that failed, the entry also has
        ``"last_ft_request_id"`` and ``"ft_error"``, as vLLM's client adds them.
        Unlike ``AsyncLLM``, whose list is empty unless
        ``--enable-fault-tolerance`` is set, the entry is always there:
        asynckv's restarts need no flag.

        Raises:
            EngineClosedError: the engine was closed.
            EngineNotStartedError: the engine is not started.
        """
        entry = self._fault_entry()
        if self._fault_refused is not None:
            entry["last_ft_request_id"], entry["ft_error"] = self._fault_refused
        return {"schema_version": 1, "total_engines": 1, "engines": [entry]}

    async def handle_fault(self, fault_tolerance_request: Any) -> Any:
        """Apply a ``FaultToleranceRequest`` and return vLLM's ``FaultToleranceResult``.

        As vLLM's engine core does, an instruction is taken only while the
        engine is unhealthy (``get_status``), that is while asynckv rebuilds
        it: otherwise the result is a failure whose reason names the status
        (``"[FT] Rejecting retry on engine 0: status is HEALTHY"``). The one
        instruction is vLLM's ``"retry"``; asynckv's ``RestartPolicy``
        already rebuilds the engine and resumes its requests by itself, so
        "retry" waits for that rebuild (a no-op command the worker applies on
        the new engine, in FIFO order with every other) and succeeds once it
        is running, or fails with the ``EngineDeadError`` if it gave up.
        Cancelling the wait leaves the rebuild alone.

        Raises:
            EngineClosedError: the engine was closed.
            EngineNotStartedError: the engine is not started.
        """
        from vllm.v1.fault_tolerance.utils import FaultToleranceResult

        request = fault_tolerance_request
        status = self._fault_entry()["status"]
        reason: str | None = None
        if status != "unhealthy":
            reason = f"[FT] Rejecting {request.instruction} on engine 0: status is {status.upper()}"
        elif request.instruction != "retry":
            reason = f"[FT] Unknown instruction {request.instruction!r}: asynckv takes 'retry'"
        else:
            try:
                await self.run_on_engine(lambda _: None)
            except EngineDeadError as dead:
                reason = str(dead)
        if reason is not None:
            self._fault_refused = (request.request_id, reason)
        return FaultToleranceResult(
            request_id=request.request_id, success=reason is None, reason=reason
        )

    def _fault_entry(self) -> dict[str, Any]:
        # One engine's entry of get_status, from the lifecycle (Running, Restarting, Dead).
        self._check_open()
        if not self._worker.started:
            raise EngineNotStartedError()
        snap = self._worker.health()
        if snap.dead_error is not None:
            return {"id": 0, "status": "dead"}
        if snap.restart_cause is not None:
            fault = type(snap.restart_cause).__name__
            return {"id": 0, "status": "unhealthy", "fault_info": fault}
        if snap.restarting:  # a planned restart: no fault to name
            return {"id": 0, "status": "unhealthy"}
        return {"id": 0, "status": "healthy"}

    @property
    def restarting(self) -> bool:
        """Whether the engine is being rebuilt now: after a death (``RestartPolicy``) or a
        planned ``restart()``; degraded, not dead."""
        return self._worker.restarting

    @property
    def errored(self) -> bool:
        """Whether the engine has died."""
        return self._worker.dead_error is not None

    @property
    def dead_error(self) -> BaseException:
        """The ``EngineDeadError`` that later calls raise (a generic one if not dead)."""
        error = self._worker.dead_error
        return error or EngineDeadError(RuntimeError("the engine is alive"))


@dataclasses.dataclass(frozen=True)
class _Rebuildable:
    """What ``from_engine_args`` builds from, so that ``restart(**overrides)`` can change it."""

    args: EngineArgs
    usage_context: UsageContext
    stat_loggers: list[StatLoggerFactory] | None

    def build(self) -> LLMEngine:
        """Build the engine (on the worker thread)."""
        from vllm import LLMEngine

        return LLMEngine.from_engine_args(
            self.args, usage_context=self.usage_context, stat_loggers=self.stat_loggers
        )

    def replaced(self, overrides: Mapping[str, Any]) -> _Rebuildable:
        """These arguments with ``overrides``; TypeError names a field ``EngineArgs`` lacks."""
        fields = {f.name for f in dataclasses.fields(self.args)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"restart() got engine arguments EngineArgs doesn't have: {unknown}")
        return dataclasses.replace(self, args=dataclasses.replace(self.args, **overrides))


# -- argument checks ------------------------------------------------------------------
#
# Of public arguments, shared by AsyncEngine and AsyncEnginePool. They run on the
# caller's thread, before anything reaches a worker, so that a wrong argument fails
# its own call at once and nothing else.


def checked_sampling_params(params: object) -> SamplingParams:
    """The request's parameters: the defaults for None; refuses what vLLM would hang on."""
    checked = SamplingParams() if params is None else params
    if not isinstance(checked, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, not {type(checked).__name__}")
    if checked.seed is not None and not -(2**63) <= checked.seed < 2**64:
        # vLLM 0.32 accepts it, then its engine core drops the request and
        # step() never returns: refuse it here.
        raise ValueError(f"seed must fit in 64 bits, got {checked.seed}")
    return checked


def checked_request_id(rid: object) -> str:
    """The given request id, or a new unique one for None."""
    checked = uuid.uuid4().hex if rid is None else rid
    if not isinstance(checked, str):
        raise TypeError(f"request_id must be a str, not {type(checked).__name__}")
    return checked


def checked_request_ids(ids: str | Iterable[str]) -> list[str]:
    """One id or many, as a list of ids."""
    checked = [ids] if isinstance(ids, str) else list(ids)
    if not all(isinstance(i, str) for i in checked):
        raise TypeError("request ids must be str")
    return checked


def checked_pause_mode(mode: object) -> PauseMode:
    """A ``pause_generation`` mode."""
    for known in get_args(PauseMode):
        if mode == known:
            return known  # type: ignore[no-any-return]
    raise ValueError(f"mode must be one of {get_args(PauseMode)}, not {mode!r}")


def checked_stream_interval(seconds: object) -> float:
    """A stream interval in seconds: a finite number >= 0 (0: every output at once)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"stream_interval must be a number of seconds, not {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"stream_interval must be finite and >= 0, got {seconds}")
    return float(seconds)


def checked_drain(seconds: object) -> float:
    """A close's drain in seconds: a finite number >= 0 (0: end what is in flight at once)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"drain must be a number of seconds, not {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"drain must be finite and >= 0, got {seconds}")
    return float(seconds)


def checked_restart(policy: object) -> RestartPolicy | None:
    """The restart policy: None (a death is final) or a ``RestartPolicy``."""
    if policy is not None and not isinstance(policy, RestartPolicy):
        raise TypeError(f"restart must be a RestartPolicy or None, not {type(policy).__name__}")
    return policy
