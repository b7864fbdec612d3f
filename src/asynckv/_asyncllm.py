"""AsyncLLM's names and shapes on ``AsyncEngine``: the methods the two share.

Code written for vLLM's ``AsyncLLM`` calls these; each has ``AsyncLLM``'s
signature and return type, sync where vLLM's is sync. Like the rest of
``AsyncEngine`` they run on the caller's thread, usually an event loop:

* every call that does work on the ``LLMEngine`` goes through
  ``run_on_engine``, so the worker thread applies it between two steps, in
  FIFO order with everything else the loops sent;
* the properties (``vllm_config``, ``model_config``, ``renderer``,
  ``input_processor``, ``tokenizer``) read only what the engine set when it
  was built and never changes after, so any thread may read them. vLLM's own
  server reads the renderer from its loop while the worker runs, as it does
  with ``AsyncLLM``, whose renderer tokenizes on its own thread pool.

Where asynckv's semantics differ from ``AsyncLLM``'s, the docstring says how.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Self, TypeVar

from vllm.usage.usage_lib import UsageContext

from ._engine_calls import EngineCalls
from ._errors import EngineClosedError, EngineNotStartedError
from ._requests import engine_options, pump

if TYPE_CHECKING:
    from vllm import LLMEngine
    from vllm.config import ModelConfig, VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.renderers import BaseRenderer
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import RequestOutputCollector
    from vllm.v1.metrics.loggers import StatLoggerFactory

    from ._stream import RequestStream
    from ._worker import Worker

__all__ = ("AsyncLLMMethods", "BuildRecord")

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _BuildTime:
    """What the ``LLMEngine`` set when it was built: it never changes after."""

    vllm_config: VllmConfig
    renderer: BaseRenderer
    input_processor: InputProcessor


class BuildRecord:
    """Keeps what the ``LLMEngine`` set at build time, for the loop side to read.

    Filled once, on the worker thread, right after the build and before the
    worker answers ``start()`` (or at once for an engine built by the caller);
    read on the loop only after that answer, so the loop sees it complete. It
    holds the engine's configs and renderer, not the engine itself.
    """

    __slots__ = ("built",)

    def __init__(self, engine: LLMEngine | None = None) -> None:
        self.built: _BuildTime | None = None
        if engine is not None:
            self.record(engine)

    def record(self, engine: LLMEngine) -> None:
        """Take the build-time attributes of ``engine`` (on the thread that built it)."""
        try:
            self.built = _BuildTime(engine.vllm_config, engine.renderer, engine.input_processor)
        except AttributeError:
            self.built = None  # a stand-in for LLMEngine (a test's fake engine) has none

    def wrap(self, build: Callable[[], LLMEngine]) -> Callable[[], LLMEngine]:
        """``build``, recording what it built here before returning it."""

        def build_and_record() -> LLMEngine:
            engine = build()
            self.record(engine)
            return engine

        return build_and_record


class AsyncLLMMethods(EngineCalls):
    """The part of ``AsyncEngine`` that mirrors ``AsyncLLM``; see the module docstring.

    The calls that the worker applies between two steps (LoRA, sleep, the
    cache resets, profiling, ...) come from ``EngineCalls``.
    """

    if TYPE_CHECKING:
        _worker: Worker
        _closed: bool
        _record: BuildRecord

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

    # -- what the engine set when it was built ---------------------------------------

    def _build_time(self) -> _BuildTime:
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

    @property
    def vllm_config(self) -> VllmConfig:
        """The engine's whole configuration, as ``AsyncLLM.vllm_config``; any thread.

        Raises ``EngineNotStartedError`` before ``start()`` has built the engine.
        """
        return self._build_time().vllm_config

    @property
    def model_config(self) -> ModelConfig:
        """The engine's model configuration, as ``AsyncLLM.model_config``; any thread."""
        return self._build_time().vllm_config.model_config

    @property
    def renderer(self) -> BaseRenderer:
        """The engine's renderer (chat templates, tokenization), as ``AsyncLLM.renderer``."""
        return self._build_time().renderer

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's input processor, as ``AsyncLLM.input_processor``; any thread."""
        return self._build_time().input_processor

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, or None with ``skip_tokenizer_init``; as ``AsyncLLM``'s."""
        return self._build_time().renderer.tokenizer

    def get_tokenizer(self) -> Any:
        """Return the engine's tokenizer (raises if it has none); sync, as ``AsyncLLM``'s."""
        return self._build_time().renderer.get_tokenizer()

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
