"""Logging, on any thread: structlog events that stay silent unless the application asks.

Runs on any thread. When the application has configured structlog, events go
through its pipeline (and ``structlog.testing.capture_logs`` sees them);
otherwise they go to the standard ``logging`` logger ``"asynckv"``, which has
only a ``NullHandler`` until the application adds one. asynckv never
configures either unless ``configure_logging()`` is called.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

__all__ = ("configure_logging", "emit", "enabled")

_std = logging.getLogger("asynckv")
_std.addHandler(logging.NullHandler())


def enabled(level: int) -> bool:
    """Whether an event at ``level`` could be seen: cheap, for hot paths."""
    return structlog.is_configured() or _std.isEnabledFor(level)


def emit(level: int, event: str, **fields: Any) -> None:
    """Log ``event`` with ``fields`` at ``level``; ``exc_info`` adds a traceback."""
    if structlog.is_configured():
        structlog.get_logger("asynckv").log(level, event, **fields)
    elif _std.isEnabledFor(level):
        exc_info = fields.pop("exc_info", None)
        detail = " ".join(f"{k}={v!r}" for k, v in fields.items())
        _std.log(level, "%s %s", event, detail, exc_info=exc_info)


def configure_logging(json: bool = False, level: int = logging.INFO) -> None:
    """Set up structlog for a script in one call: console lines, or JSON lines.

    Events go to standard error. This configures structlog globally, so call
    it from applications and scripts, never from a library.
    """
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors.append(structlog.processors.dict_tracebacks)
    processors.append(renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
