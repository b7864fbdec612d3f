"""Helpers shared by the tests: engine arguments, starting engines, engine queries."""

from __future__ import annotations

import asyncio
from pathlib import Path

from vllm import EngineArgs

from asynckv import AsyncEngine


def engine_args(model: Path, **overrides: object) -> EngineArgs:
    """EngineArgs for the tiny model, small enough for 2 CPU cores."""
    settings: dict[str, object] = {
        "model": str(model),
        "max_model_len": 512,
        "max_num_seqs": 32,
        "seed": 0,
        "disable_log_stats": True,
    }
    settings.update(overrides)
    return EngineArgs(**settings)  # type: ignore[arg-type]


def start_engine(args: EngineArgs) -> AsyncEngine:
    engine = AsyncEngine.from_engine_args(args)
    asyncio.run(engine.start())
    return engine


async def unfinished(engine: AsyncEngine) -> int:
    """How many requests the LLMEngine still holds, asked between two steps."""
    count: int = await engine.run_on_engine(lambda e: e.get_num_unfinished_requests())
    return count
