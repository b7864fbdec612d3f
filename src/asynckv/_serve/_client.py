"""AsyncEngineClient: vLLM's ``EngineClient`` over an ``AsyncEngine``, on the server's loop.

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
import dataclasses
import threading
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import vllm.exceptions
from vllm.engine.protocol import EngineClient
from vllm.tasks import POOLING_TASKS
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.engine.exceptions import EngineGenerateError

from .._errors import EngineClosedError
from .._loop._inputs import is_streaming_input
from .._loop._requests import RequestArgs, engine_options

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams

    from .._loop._engine import AsyncEngine
    from .._types import PauseMode

__all__ = ("AsyncEngineClient",)

# How long shutdown() waits for the worker once the drain is over (a bound, never a wait).
_SHUTDOWN_WAIT_SECONDS = 30.0

# What a request refused or cut by a shutdown gets: vLLM's server answers 503 with it.
_SHUTTING_DOWN = "the server is shutting down: retry this request on another instance"

# The errors AsyncLLM.generate passes on unwrapped, besides EngineDeadError: the
# client's (a bad request, an admission refusal). vLLM before 0.32 (0.26 on the GPU
# machine) has neither class and passes ValueError, its validation errors' base.
_CLIENT_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(vllm.exceptions, name)
    for name in ("VLLMClientError", "GracefulHTTPError")
    if hasattr(vllm.exceptions, name)
) or (ValueError,)


def _shutting_down() -> Exception:
    # vLLM before 0.32 (0.26 on the GPU machine) has no RetryableRequestError: a 500 there.
    retryable = getattr(vllm.exceptions, "RetryableRequestError", None)
    error: Exception = (retryable or EngineGenerateError)(_SHUTTING_DOWN)
    return error


class AsyncEngineClient(EngineClient):  # type: ignore[misc]  # vLLM's classes are Any to mypy
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
    what a method asks (pooling, streaming inputs, elastic expert
    parallelism), it raises ``NotImplementedError``. vLLM's fault-tolerance
    calls (``get_status``, ``handle_fault``) answer from asynckv's own
    lifecycle: its restarts under a ``RestartPolicy``.

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
        collection) aborts the request. The request arguments are checked
        first, on this loop, as ``AsyncEngine.generate`` checks them:
        ``data_parallel_rank`` 0 or None (one engine core), anything else
        refused with ``AsyncLLM``'s ``VLLMValidationError``.

        Raises:
            NotImplementedError: ``prompt`` is an async generator (streaming input).
            VLLMValidationError: a ``data_parallel_rank`` other than 0.
            EngineDeadError: the engine died (asynckv's, which is vLLM's too);
                its message names the cause.
            RetryableRequestError: the engine is shutting down (vLLM's 503,
                "the server is shutting down"), whether the request was cut
                or refused by a drain; from the ``EngineClosedError``.
            EngineGenerateError: any other failure, from the original error,
                which its message names; vLLM's ``VLLMClientError``s (a bad
                request) pass unchanged.
        """
        args = RequestArgs(
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
        if is_streaming_input(prompt):
            # Each input brings its own prompt text (_loop/_inputs.py).
            args = dataclasses.replace(args, prompt_text=None)
            async for out in self._streaming(prompt, sampling_params, request_id, args):
                yield out
            return
        count = sampling_params.n
        with self._lock:
            self._unfinished += count
        try:
            options = await engine_options(self.engine, args)
            async with self.engine.generate(prompt, sampling_params, request_id, **options) as s:
                async for out in s:
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            raise  # leaving the block has aborted the request
        except (VllmEngineDeadError, NotImplementedError, *_CLIENT_ERRORS):
            raise
        except EngineClosedError as exc:
            # A shutdown, not a failure: vLLM's serving layer answers this error
            # with a 503 (an error event on a stream) and logs no traceback.
            raise _shutting_down() from exc
        except Exception as exc:
            raise EngineGenerateError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                self._unfinished -= count

    async def _streaming(
        self, inputs: Any, params: SamplingParams, request_id: str, args: RequestArgs
    ) -> AsyncGenerator[RequestOutput, None]:
        # A streaming input (vLLM's streaming sessions, _loop/_inputs.py), with AsyncLLM's
        # outputs and errors: the input stream's own error is raised as it is.
        with self._lock:
            self._unfinished += 1
        feeder = None
        try:
            stream, feeder = self.engine._stream_inputs(
                inputs, params, request_id, args.checked(), 0.0
            )
            async with stream:
                async for out in stream:
                    if out.finished and feeder.ended_quietly:
                        break  # AsyncLLM's generator ends there, with nothing more
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except (VllmEngineDeadError, NotImplementedError, *_CLIENT_ERRORS):
            raise
        except EngineClosedError as exc:
            raise _shutting_down() from exc  # a shutdown, as for any request (503)
        except Exception as exc:
            if feeder is not None and exc is feeder.error:
                raise
            raise EngineGenerateError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                self._unfinished -= 1

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
        """Raise unless the engine is usable (``AsyncEngine.check_health``).

        As ``AsyncLLM``'s, it raises ``dead_error`` whenever ``errored`` is true.
        """
        if self.errored:
            raise self.dead_error
        await self.engine.check_health()

    async def get_status(self) -> dict[str, Any]:
        """The fault-tolerance status, in ``AsyncLLM``'s shape (``AsyncEngine.get_status``)."""
        return await self.engine.get_status()

    async def handle_fault(self, fault_tolerance_request: Any) -> Any:
        """Apply a ``FaultToleranceRequest`` (``AsyncEngine.handle_fault``): ``"retry"``."""
        return await self.engine.handle_fault(fault_tolerance_request)

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
        """Close the engine, first letting admitted requests finish for ``timeout`` s; blocking.

        ``timeout`` is vLLM's drain time (``--shutdown-timeout``, which vLLM's
        server passes on SIGTERM): the requests already admitted go on for up
        to that long while every new one is refused (503, "the server is
        shutting down"); then, or at once with 0 or None (vLLM's default),
        what is still in flight ends with that same error. The wait for the
        worker and its engine processes after that is bounded separately (30
        s). Any thread; idempotent.
        """
        self.engine.shutdown(_SHUTDOWN_WAIT_SECONDS, drain=timeout or 0.0)

    async def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: int = 300) -> None:
        """Not supported: one ``LLMEngine`` has no elastic expert parallelism."""
        raise NotImplementedError(
            "asynckv runs one LLMEngine: elastic expert parallelism is not supported"
        )

    # -- pausing, caches, sleep ----------------------------------------------------------

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """Pause generation (``AsyncEngine.pause_generation``: asynckv's own pause)."""
        await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        """Resume after ``pause_generation``."""
        await self.engine.resume_generation()

    async def is_paused(self) -> bool:
        """Whether ``pause_generation`` is in force."""
        return await self.engine.is_paused()

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Reset the prefix cache between two steps and return vLLM's answer."""
        return await self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    async def reset_mm_cache(self) -> None:
        """Clear the multi-modal caches."""
        await self.engine.reset_mm_cache()

    async def reset_encoder_cache(self) -> None:
        """Invalidate the cached encoder outputs."""
        await self.engine.reset_encoder_cache()

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Put the engine to sleep (``AsyncEngine.sleep``)."""
        await self.engine.sleep(level, mode)

    async def release_kv_cache_memory(self) -> None:
        """Discard the KV cache's memory (after a completed pause)."""
        await self.engine.release_kv_cache_memory()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the engine up; return whether it is fully awake."""
        return await self.engine.wake_up(tags)

    async def is_sleeping(self) -> bool:
        """Whether the engine is asleep."""
        return await self.engine.is_sleeping()

    # -- LoRA, profiling, workers --------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter into the engine."""
        return await self.engine.add_lora(lora_request)

    async def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Start vLLM's profiler."""
        await self.engine.start_profile(
            profile_prefix, delay_iterations=delay_iterations, max_iterations=max_iterations
        )

    async def stop_profile(self) -> None:
        """Stop vLLM's profiler."""
        await self.engine.stop_profile()

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every model worker."""
        return await self.engine.collective_rpc(method, timeout, args, kwargs)

    # -- weights (reinforcement learning) ------------------------------------------------

    async def init_weight_transfer_engine(self, request: Any) -> None:
        """Set up weight transfer from a trainer, on every worker (as ``AsyncLLM``)."""
        await self.collective_rpc(
            "init_weight_transfer_engine", kwargs={"init_info": request.init_info}
        )

    async def shutdown_weight_transfer_engine(self) -> None:
        """Release the trainer's connection; inference goes on."""
        await self.collective_rpc("shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        """Start a weight update."""
        await self.collective_rpc("start_weight_update")

    async def start_draft_weight_update(self) -> None:
        """Start a weight update of the speculative draft model."""
        await self.collective_rpc("start_draft_weight_update")

    async def update_weights(self, request: Any) -> None:
        """Apply a batch of a weight update."""
        await self.collective_rpc("update_weights", kwargs={"update_info": request.update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish a weight update and, if given, set the weights' version."""
        await self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        """Set the weights' version, which outputs then carry."""
        await self.engine.run_on_engine(lambda e: e.set_weight_version(new_version))

    async def get_weight_version(self) -> str:
        """The weights' latest version."""
        version: str = await self.engine.run_on_engine(lambda e: e.get_weight_version())
        return version
