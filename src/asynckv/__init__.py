"""asynckv: an async facade (asyncio, trio) over vLLM's ``LLMEngine``, on its own worker thread."""

from __future__ import annotations

from ._api import AsyncEngineAPI
from ._errors import (
    AsyncKVError,
    EngineClosedError,
    EngineDeadError,
    EngineHeldError,
    EngineNotStartedError,
    EngineRestartingError,
    EngineStalledError,
    RequestNotResumedError,
)
from ._log import configure_logging
from ._loop._engine import AsyncEngine
from ._loop._steps import StepStream
from ._loop._stream import RequestMetrics, RequestStream
from ._pool._pool import AsyncEnginePool
from ._serve._client import AsyncEngineClient
from ._stats import EngineStats, StepRecord
from ._types import Drained, RestartPolicy

__all__ = (
    "AsyncEngine",
    "AsyncEngineAPI",
    "AsyncEngineClient",
    "AsyncEnginePool",
    "AsyncKVError",
    "Drained",
    "EngineClosedError",
    "EngineDeadError",
    "EngineHeldError",
    "EngineNotStartedError",
    "EngineRestartingError",
    "EngineStalledError",
    "EngineStats",
    "RequestMetrics",
    "RequestNotResumedError",
    "RequestStream",
    "RestartPolicy",
    "StepRecord",
    "StepStream",
    "configure_logging",
)

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
