"""AsyncLLM's names and shapes on ``AsyncEngine``: the methods the two share.

Code written for vLLM's ``AsyncLLM`` calls these; each has ``AsyncLLM``'s
signature and return type, sync where vLLM's is sync. Like the rest of
``AsyncEngine`` they run on the caller's thread, usually an event loop:

* every call that does work on the ``LLMEngine`` goes through
  ``run_on_engine``, so the worker thread applies it between two steps, in
  FIFO order with everything else the loops sent;
* the properties (``vllm_config``, ``model_config``, ``renderer``,
  ``input_processor``, ``tokenizer``) read only what the engine set when it
  was built and never changes after, so any thread may read them; they are
  in ``_build_time.py``.

Where asynckv's semantics differ from ``AsyncLLM``'s, the docstring says how.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Self, TypeVar

from vllm.usage.usage_lib import UsageContext

from ._build_time import BuildTimeAttributes
from ._engine_calls import EngineCalls
from ._requests import engine_options, pump

if TYPE_CHECKING:
    from vllm import LLMEngine
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.output_processor import RequestOutputCollector
    from vllm.v1.metrics.loggers import StatLoggerFactory

    from .._worker._worker import Worker
    from ._stream import RequestStream

__all__ = ("AsyncLLMMethods",)

R = TypeVar("R")


class AsyncLLMMethods(BuildTimeAttributes, EngineCalls):
    """The part of ``AsyncEngine`` that mirrors ``AsyncLLM``; see the module docstring.

    The build-time properties (``vllm_config``, ``renderer``, ...) come from
    ``BuildTimeAttributes``; the calls that the worker applies between two
    steps (LoRA, sleep, the cache resets, profiling, ...) from ``EngineCalls``.
    """

    if TYPE_CHECKING:
        _worker: Worker
        _closed: bool

        @property
        def errored(self) -> bool: ...

        async def run_on_engine(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R: ...

        @classmethod
        def _unstarted(
            cls, build: Callable[[], LLMEngine], freeze_gc: bool, stream_interval: float = 0.0
        ) -> Self: ...

        def generate(
            self,
            prompt: Any,
            sampling_params: SamplingParams | None = None,
            request_id: str | None = None,
            **kwargs: Any,
        ) -> RequestStream: ...

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
    ) -> Self:
        """Make an engine that ``start()`` will build from ``vllm_config``, as ``AsyncLLM``'s.

        The engine is built on the worker thread by ``start()``, in vLLM's
        multiprocess mode unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, with
        stats on unless ``disable_log_stats`` (they feed vLLM's stat loggers:
        its log line, its Prometheus metrics and any ``stat_loggers``).
        ``enable_log_requests`` changes nothing: asynckv logs every request at
        DEBUG through its own logger (``configure_logging``).
        ``start_engine_loop``: as in ``from_engine_args``.

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

        return cls._unstarted(build, freeze_gc, stream_interval)

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

    # -- requests ----------------------------------------------------------------------

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

        prompt, options = await engine_options(
            self,
            request_id,
            prompt,
            params,
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
        collector = RequestOutputCollector(params.output_kind, request_id)
        pump(self.generate(prompt, params, request_id, **options), collector)
        return collector

    def encode(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not supported: asynckv streams generation requests only.

        ``LLMEngine`` can run pooling models, but asynckv's streams carry
        ``RequestOutput``s of ``SamplingParams`` requests.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "asynckv serves generation requests only: encode() (pooling models) is not supported"
        )

    async def notify_kv_transfer_request_rejected(
        self,
        request_id: str,
        kv_transfer_params: dict[str, Any],
        *,
        data_parallel_rank: int | None = None,
    ) -> None:
        """Let a KV connector free what it pinned for a request rejected before admission.

        As ``AsyncLLM``'s: submits a pre-aborted request straight to the
        engine core, which runs the connector's ``request_finished`` hook.
        """
        import time

        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        fields = getattr(SamplingParams, "__struct_fields__", ())
        extra = {"watermarking": False} if "watermarking" in fields else {}
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=[0],
            mm_features=None,
            sampling_params=SamplingParams(
                max_tokens=1, extra_args={"kv_transfer_params": dict(kv_transfer_params)}, **extra
            ),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=data_parallel_rank,
            abort_immediately=True,
        )
        await self.run_on_engine(lambda e: e.engine_core.add_request(request))
