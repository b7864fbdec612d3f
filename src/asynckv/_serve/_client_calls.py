"""The pass-throughs of ``AsyncEngineClient``: pausing, caches, sleep, LoRA, profiling, weights.

Each is ``EngineClient``'s method with its signature, forwarded to the
``AsyncEngine`` under the client. Runs on the event loop that serves the
requests; nothing here touches the ``LLMEngine``: the engine's worker thread
applies each call between two steps, in FIFO order with everything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from .._loop._engine import AsyncEngine
    from .._types import PauseMode

__all__ = ("ClientCalls",)


class ClientCalls:
    """``EngineClient``'s calls that ``AsyncEngineClient`` forwards to its engine."""

    if TYPE_CHECKING:
        engine: AsyncEngine

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
