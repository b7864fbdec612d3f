"""AsyncLLM's calls that the worker applies between two steps, on ``AsyncEngine``.

Each has ``AsyncLLM``'s signature and return type and goes through
``run_on_engine``: the caller's event loop sends it, and the worker thread
calls the ``LLMEngine`` between two steps, in FIFO order with everything else
the loops sent, and answers on the caller's loop. No step runs meanwhile, so
none of them may take long. Cancelling the caller's await does not undo a call
the worker has already taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import EngineClosedError
from .._types import PauseMode

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest

__all__ = ("EngineCalls",)

R = TypeVar("R")


class EngineCalls:
    """The ``AsyncLLM`` calls of ``AsyncEngine`` that the worker runs; see the module docstring."""

    if TYPE_CHECKING:

        @property
        def vllm_config(self) -> VllmConfig: ...

        @property
        def is_running(self) -> bool: ...

        async def run_on_engine(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R: ...

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

    async def is_tracing_enabled(self) -> bool:
        """Whether OpenTelemetry tracing is configured (``--otlp-traces-endpoint``)."""
        return self.vllm_config.observability_config.otlp_traces_endpoint is not None

    async def do_log_stats(self) -> None:
        """Log vLLM's periodic stats line now (its stat loggers' ``log()``).

        ``LLMEngine.step()`` already records every step into its stat loggers
        (Prometheus among them) and logs at ``VLLM_LOG_STATS_INTERVAL``; vLLM's
        server also calls this every interval. A no-op once the engine is
        closed or dead, so that periodic caller never fails.
        """
        if not self.is_running:
            return
        try:
            await self.run_on_engine(lambda e: e.do_log_stats())
        except EngineClosedError:
            return
