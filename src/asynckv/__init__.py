"""asynckv: an async facade (asyncio, trio) over vLLM's ``LLMEngine``, on its own worker thread."""

from __future__ import annotations

from ._api import AsyncEngineAPI
from ._client import AsyncEngineClient
from ._engine import AsyncEngine
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
from ._metrics import RequestMetrics
from ._pool import AsyncEnginePool
from ._restart import RestartPolicy
from ._stats import EngineStats
from ._steps import StepRecord, StepStream
from ._stream import RequestStream

__all__ = (
    "AsyncEngine",
    "AsyncEngineAPI",
    "AsyncEngineClient",
    "AsyncEnginePool",
    "AsyncKVError",
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
