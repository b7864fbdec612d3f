"""AsyncEngineClient: vLLM's ``EngineClient`` protocol over an ``AsyncEngine``.

vLLM's whole serving layer (``vllm.entrypoints``: the OpenAI server, chat
templates, tools, structured outputs, tokenize, models, LoRA, metrics) runs on
any ``EngineClient``; ``AsyncLLM`` is vLLM's own. This one puts asynckv's
engine under that layer, so the same server code runs on either.

Runs on the event loop that serves the requests, like ``AsyncEngine``; the
sync ``shutdown`` may run on any thread (vLLM's server calls it from an
executor). Nothing here touches the ``LLMEngine``: everything goes through the
``AsyncEngine``, whose worker thread owns it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import vllm.exceptions
from vllm.engine.protocol import EngineClient
from vllm.tasks import POOLING_TASKS
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.engine.exceptions import EngineGenerateError

from .._loop._requests import engine_options
from ._client_calls import ClientCalls

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams

    from .._loop._engine import AsyncEngine

__all__ = ("AsyncEngineClient",)

# How long shutdown() lets the worker stop cleanly, whatever drain time vLLM asks for.
_SHUTDOWN_WAIT_SECONDS = 30.0

# The errors AsyncLLM.generate passes on unwrapped, besides EngineDeadError: the
# client's (a bad request, an admission refusal). vLLM before 0.32 (0.26 on the GPU
# machine) has neither class and passes ValueError, its validation errors' base.
_CLIENT_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(vllm.exceptions, name)
    for name in ("VLLMClientError", "GracefulHTTPError")
    if hasattr(vllm.exceptions, name)
) or (ValueError,)


class AsyncEngineClient(ClientCalls, EngineClient):  # type: ignore[misc]  # vLLM's classes are Any to mypy
    """vLLM's ``EngineClient`` over a started ``AsyncEngine``.

    Pass it wherever vLLM takes an engine client, ``AsyncLLM``'s place:
    ``vllm.entrypoints``' ``build_and_serve(client, ...)`` serves vLLM's OpenAI
    API on it (``python -m asynckv.serve`` does exactly that). ``vllm_config``,
    ``model_config``, ``renderer`` and ``input_processor`` are the engine's own,
    set when it was built. ``generate`` is an async generator with
    ``EngineClient.generate``'s signature: leaving it early (a ``break``, a
    cancelled task, a client that disconnects) aborts the request before the
    engine's next step. Errors follow ``AsyncLLM``: vLLM's client errors and
    ``EngineDeadError`` as they are, anything else raised as
    ``EngineGenerateError`` from the original.

    The engine stays the caller's: ``shutdown()`` closes it (vLLM's server
    calls it on SIGTERM), nothing else here does. Where ``LLMEngine`` can't do
    what a method asks (pooling, streaming inputs, elastic expert parallelism,
    fault tolerance), it raises ``NotImplementedError``.

    Raises:
        EngineNotStartedError: the engine is not started.
        NotImplementedError: ``--max-num-queued-tokens`` is set: it counts
            prefill tokens that only the worker thread can see.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        """The ``AsyncEngine`` under this client."""
        self.vllm_config = engine.vllm_config
        self.model_config = engine.model_config
        self.renderer = engine.renderer
        self.input_processor = engine.input_processor
        scheduler = self.vllm_config.scheduler_config
        if getattr(scheduler, "max_num_queued_tokens", None) is not None:
            raise NotImplementedError(
                "max_num_queued_tokens is not supported on asynckv: "
                "the prefill backlog is only known on the engine's worker thread"
            )
        self._max_queued: int | None = getattr(scheduler, "max_num_queued_reqs", None)
        # Sequences inside generate(), counted as AsyncLLM counts its unfinished ones.
        self._lock = threading.Lock()
        self._unfinished = 0

    # -- requests ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generate a request's outputs, in order, the last with ``finished=True``.

        The request is submitted when the generator is first iterated. vLLM's
        server drives it in a task per request and cancels that task when the
        client goes away; the cancellation (or ``aclose()``, or garbage
        collection) aborts the request. With ``data_parallel_rank`` or a
        reasoning field set, vLLM's input processor builds the engine request
        on the worker first (one more pass of the worker).

        Raises:
            NotImplementedError: ``prompt`` is an async generator (streaming input).
            EngineDeadError: the engine died (asynckv's, which is vLLM's too).
            EngineGenerateError: any other failure, from the original error;
                vLLM's ``VLLMClientError``s (a bad request) pass unchanged.
        """
        count = sampling_params.n
        with self._lock:
            self._unfinished += count
        try:
            prompt, options = await engine_options(
                self.engine,
                request_id,
                prompt,
                sampling_params,
                prompt_text=prompt_text,
                lora_request=lora_request,
                tokenization_kwargs=tokenization_kwargs,
                trace_headers=trace_headers,
                priority=priority,
                data_parallel_rank=data_parallel_rank,
                session_id=session_id,
                kv_hints=kv_hints,
                reasoning_ended=reasoning_ended,
                reasoning_parser_kwargs=reasoning_parser_kwargs,
            )
            async with self.engine.generate(prompt, sampling_params, request_id, **options) as s:
                async for out in s:
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            raise  # leaving the block has aborted the request
        except (VllmEngineDeadError, NotImplementedError, *_CLIENT_ERRORS):
            raise
        except Exception as exc:
            raise EngineGenerateError() from exc
        finally:
            with self._lock:
                self._unfinished -= count

    def encode(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """Not supported (pooling models): raises ``NotImplementedError``.

        ``get_supported_tasks`` leaves the pooling tasks out, so vLLM's server
        registers no pooling endpoint that would call this.
        """
        self.engine.encode()

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Refuse a request up front beyond ``--max-num-queued-reqs``, as ``AsyncLLM`` does.

        It counts the sequences now inside ``generate`` (a request with ``n``
        completions counts ``n``), and raises vLLM's ``QueueOverflowError``
        (HTTP 503) when adding ``n`` would exceed the limit. As with
        ``AsyncLLM``, requests checked at once and not yet generating are not
        counted, so a burst can overshoot. A no-op without the limit.
        """
        limit = self._max_queued
        if limit is None:
            return
        with self._lock:
            over = self._unfinished + n > limit
        if over:
            from vllm.exceptions import QueueOverflowError

            raise QueueOverflowError()

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests and return once they are out of the engine (``AsyncEngine.abort``)."""
        await self.engine.abort(request_id, internal)

    async def notify_kv_transfer_request_rejected(
        self,
        request_id: str,
        kv_transfer_params: dict[str, Any],
        *,
        data_parallel_rank: int | None = None,
    ) -> None:
        """See ``AsyncEngine.notify_kv_transfer_request_rejected``."""
        await self.engine.notify_kv_transfer_request_rejected(
            request_id, kv_transfer_params, data_parallel_rank=data_parallel_rank
        )

    # -- state ---------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """Whether the engine is started and neither closed nor dead."""
        return self.engine.is_running

    @property
    def is_stopped(self) -> bool:
        """Whether the engine was closed or has died."""
        return self.engine.is_stopped

    @property
    def errored(self) -> bool:
        """Whether the engine has died."""
        return self.engine.errored

    @property
    def dead_error(self) -> BaseException:
        """The ``EngineDeadError`` that calls raise once the engine has died."""
        return self.engine.dead_error

    async def check_health(self) -> None:
        """Raise unless the engine is usable (``AsyncEngine.check_health``)."""
        await self.engine.check_health()

    async def get_supported_tasks(self) -> tuple[Any, ...]:
        """The model's tasks, less the pooling ones, which asynckv does not serve."""
        tasks = await self.engine.get_supported_tasks()
        return tuple(task for task in tasks if task not in POOLING_TASKS)

    async def is_tracing_enabled(self) -> bool:
        """Whether OpenTelemetry tracing is configured."""
        return await self.engine.is_tracing_enabled()

    async def do_log_stats(self) -> None:
        """Log vLLM's stats line (``AsyncEngine.do_log_stats``)."""
        await self.engine.do_log_stats()

    def shutdown(self, timeout: float | None = None) -> None:
        """Close the engine: streams in flight end with ``EngineClosedError``; blocking.

        vLLM's ``timeout`` is a drain time (0, its default, aborts at once).
        asynckv always ends what is in flight at once, so it only bounds the
        wait for the worker and its engine processes to stop, which is given
        at least 30 seconds so that they stop cleanly. Any thread; idempotent.
        """
        self.engine.shutdown(max(timeout or 0.0, _SHUTDOWN_WAIT_SECONDS))

    async def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: int = 300) -> None:
        """Not supported: one ``LLMEngine`` has no elastic expert parallelism."""
        raise NotImplementedError(
            "asynckv runs one LLMEngine: elastic expert parallelism is not supported"
        )
