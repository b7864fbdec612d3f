"""AsyncLLM's names and shapes on ``AsyncEngine``, on the caller's loop; and the build record.

Code written for vLLM's ``AsyncLLM`` calls these; each has ``AsyncLLM``'s
signature and return type, sync where vLLM's is sync. They run on the
caller's thread, usually an event loop, and depend on their host
(``AsyncEngine``) for two things only, which it overrides:

* ``run_on_engine``: every call that does work on the ``LLMEngine`` goes
  through it, so the worker thread applies it between two steps, in FIFO
  order with everything else the loops sent, and answers on the caller's
  loop. No step runs meanwhile, so none of them may take long. Cancelling
  the caller's await does not undo a call the worker has already taken;
* ``_build_time``: what the engine set when it was built (``BuildTime``),
  which the properties (``vllm_config``, ``model_config``, ``renderer``,
  ``input_processor``, ``tokenizer``) and ``get_tokenizer`` read. It never
  changes after the build, so any thread may read them: vLLM's own server
  reads the renderer from its loop while the worker runs, as it does with
  ``AsyncLLM``, whose renderer tokenizes on its own thread pool.

``BuildRecord.record`` runs on the worker thread, right after the build and
before the worker answers ``start()`` (or on the caller's thread, at once,
for an engine built by the caller).

Where asynckv's semantics differ from ``AsyncLLM``'s, the docstring says how.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .. import _vllm
from .._errors import EngineClosedError, EngineDeadError, EngineNotStartedError
from .._types import PauseMode
from .._vllm import BuildTime

if TYPE_CHECKING:
    from vllm import LLMEngine
    from vllm.config import ModelConfig, VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.renderers import BaseRenderer
    from vllm.v1.engine.input_processor import InputProcessor

__all__ = ("AsyncLLMMethods", "BuildRecord")

R = TypeVar("R")


class BuildRecord:
    """Keeps what the ``LLMEngine`` set at build time, for the loop side to read.

    Filled once, on the worker thread, right after the build and before the
    worker answers ``start()`` (or at once for an engine built by the caller);
    read on the loop only after that answer, so the loop sees it complete. It
    holds the engine's configs and renderer, not the engine itself.
    """

    __slots__ = ("built",)

    def __init__(self, engine: LLMEngine | None = None) -> None:
        self.built: BuildTime | None = None
        if engine is not None:
            self.record(engine)

    def record(self, engine: LLMEngine) -> None:
        """Take the build-time attributes of ``engine`` (on the thread that built it)."""
        self.built = _vllm.read_build_time(engine)

    def wrap(self, build: Callable[[], LLMEngine]) -> Callable[[], LLMEngine]:
        """``build``, recording what it built here before returning it."""

        def build_and_record() -> LLMEngine:
            engine = build()
            self.record(engine)
            return engine

        return build_and_record


class AsyncLLMMethods:
    """The part of ``AsyncEngine`` that mirrors ``AsyncLLM``; see the module docstring."""

    async def run_on_engine(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``fn(llm_engine, *args, **kwargs)`` on the worker between two steps (the host's)."""
        raise NotImplementedError

    def _build_time(self) -> BuildTime:
        """What the engine set when it was built (the host's); raises if there is none yet."""
        raise NotImplementedError

    # -- build time, any thread --------------------------------------------------------

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

    async def is_tracing_enabled(self) -> bool:
        """Whether OpenTelemetry tracing is configured (``--otlp-traces-endpoint``)."""
        return self.vllm_config.observability_config.otlp_traces_endpoint is not None

    # -- calls the worker applies between two steps ------------------------------------

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks the model supports (``"generate"``, ...), as vLLM reports them."""
        return tuple(await self.run_on_engine(lambda e: e.get_supported_tasks()))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter into the engine."""
        return bool(await self.run_on_engine(lambda e: e.add_lora(lora_request)))

    async def remove_lora(self, lora_id: int) -> bool:
        """Remove a loaded LoRA adapter."""
        return bool(await self.run_on_engine(lambda e: e.remove_lora(lora_id)))

    async def list_loras(self) -> set[int]:
        """The ids of the loaded LoRA adapters."""
        return set(await self.run_on_engine(lambda e: e.list_loras()))

    async def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded LoRA adapter from being evicted."""
        return bool(await self.run_on_engine(lambda e: e.pin_lora(lora_id)))

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Put the engine to sleep (free its accelerator memory) at ``level``.

        ``mode`` says what happens to requests in flight, as for
        ``AsyncLLM.sleep``; vLLM's engine core applies it. Needs a GPU.
        """
        await self.run_on_engine(lambda e: e.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the engine (or the ``tags`` resources) up; return whether it is fully awake."""
        awake = await self.run_on_engine(lambda e: e.wake_up(tags))
        # vLLM before 0.32 returns None, having woken everything it was asked to.
        return True if awake is None else bool(awake)

    async def is_sleeping(self) -> bool:
        """Whether the engine is asleep."""
        return bool(await self.run_on_engine(lambda e: e.is_sleeping()))

    async def collective_rpc(
        self,
        method: str | Callable[..., R],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[R]:
        """Run ``method`` on every model worker, as ``LLMEngine.collective_rpc``.

        No step runs until it returns: keep it short.
        """
        result: list[R] = await self.run_on_engine(
            lambda e: e.collective_rpc(method, timeout, args, kwargs)
        )
        return result

    async def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Start vLLM's profiler (configured with ``--profiler-config``)."""
        bounds = {
            key: value
            for key, value in (
                ("delay_iterations", delay_iterations),
                ("max_iterations", max_iterations),
            )
            if value is not None
        }
        await self.run_on_engine(lambda e: e.start_profile(profile_prefix, **bounds))

    async def stop_profile(self) -> None:
        """Stop vLLM's profiler."""
        await self.run_on_engine(lambda e: e.stop_profile())

    async def reset_mm_cache(self) -> None:
        """Clear the multi-modal caches (a no-op for a text-only model)."""
        await self.run_on_engine(lambda e: e.reset_mm_cache())

    async def reset_encoder_cache(self) -> None:
        """Invalidate the cached encoder outputs (after a weight update, say)."""
        await self.run_on_engine(lambda e: e.reset_encoder_cache())

    async def release_kv_cache_memory(self) -> None:
        """Discard the KV cache's memory; vLLM requires a completed pause first."""
        await self.run_on_engine(lambda e: e.release_kv_cache_memory())

    async def do_log_stats(self) -> None:
        """Log vLLM's periodic stats line now (its stat loggers' ``log()``).

        ``LLMEngine.step()`` already records every step into its stat loggers
        (Prometheus among them) and logs at ``VLLM_LOG_STATS_INTERVAL``; vLLM's
        server also calls this every interval. A no-op before the engine is
        started and once it is closed or dead, so that periodic caller never fails.
        """
        try:
            await self.run_on_engine(lambda e: e.do_log_stats())
        except (EngineClosedError, EngineDeadError, EngineNotStartedError):
            return

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
        request = _vllm.rejected_kv_request(request_id, kv_transfer_params, data_parallel_rank)
        await self.run_on_engine(_vllm.add_core_request, request)
