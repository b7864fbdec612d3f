"""RequestMetrics: the timings of one request, and the loop-side record that makes them.

Runs on the stream's event loop (``Timeline`` is driven by ``_Sink``). Times
are on the ``time.monotonic`` clock, which vLLM's engine-core timestamps also
use, so the engine's own figures are taken where vLLM gives them (they need
``disable_log_stats=False``, vLLM's default) and ours where it doesn't.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import RequestOutputKind

from .._errors import EngineClosedError, EngineDeadError
from .._log import emit, enabled
from .._vllm import request_stat

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

__all__ = ("RequestMetrics",)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings and counts of one finished request; times on the ``time.monotonic`` clock."""

    submitted: float
    """When ``generate()`` was called."""
    scheduled: float | None
    """When the engine first scheduled it (vLLM's timestamp), if known."""
    first_token: float | None
    """When its first token was produced (vLLM's timestamp, else when it reached the loop)."""
    last_token: float | None
    """When its last token was produced (as ``first_token``)."""
    finished: float
    """When its final output reached the stream."""
    prompt_tokens: int
    output_tokens: int
    """Generated tokens over all ``n`` completions."""
    n: int
    """Completions (the request's ``n``)."""
    preemptions: int | None
    """Times the engine preempted it (a prefix-cache reset of running requests counts).

    None when not known: vLLM's per-request stats are off (``disable_log_stats``)
    or this vLLM version does not count preemptions (0.26 doesn't).
    """
    finish_reason: str | None
    """The first completion's finish reason ("length", "stop", "abort", ...)."""
    restarts: int = 0
    """Restarts of a dead engine that the request lived through (``RestartPolicy``)."""

    @property
    def queue_time(self) -> float | None:
        """Seconds from submission to first scheduling, if known."""
        return None if self.scheduled is None else max(0.0, self.scheduled - self.submitted)

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token."""
        return None if self.first_token is None else max(0.0, self.first_token - self.submitted)

    @property
    def mean_itl(self) -> float | None:
        """Mean seconds between two tokens of one completion."""
        per_completion = self.output_tokens // max(1, self.n)
        if self.first_token is None or self.last_token is None or per_completion < 2:
            return None
        return (self.last_token - self.first_token) / (per_completion - 1)


class Timeline:
    """What one stream has seen, turned into ``RequestMetrics`` and log events."""

    __slots__ = (
        "_submitted",
        "abort_reason",
        "delta_tokens",
        "first_at",
        "metrics",
        "request_id",
        "restarts",
        "stats",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.first_at: float | None = None
        self.delta_tokens = 0
        self.stats: Any = None
        self.abort_reason: str | None = None
        self.metrics: RequestMetrics | None = None
        self.restarts = 0
        self._submitted = time.monotonic()

    def output(self, out: RequestOutput, kind: RequestOutputKind) -> None:
        """Note one output as it reaches the stream."""
        if out.metrics is not None:
            self.stats = out.metrics
        completions = out.outputs
        if kind is RequestOutputKind.DELTA:
            # Once per output on the loop: one completion (n == 1) needs no generator.
            if len(completions) == 1:
                self.delta_tokens += len(completions[0].token_ids)
            else:
                self.delta_tokens += sum(len(c.token_ids) for c in completions)
        if self.first_at is None and any(c.token_ids for c in completions):
            self.first_at = time.monotonic()
            if enabled(logging.DEBUG):
                ttft = round(self.first_at - self._submitted, 6)
                emit(logging.DEBUG, "first token", request_id=self.request_id, ttft=ttft)

    def finish(self, final: RequestOutput, kind: RequestOutputKind) -> None:
        """Make the metrics of a request whose final output arrived, and log it."""
        stats = self.stats
        now = time.monotonic()
        tokens = (
            self.delta_tokens
            if kind is RequestOutputKind.DELTA
            else sum(len(c.token_ids) for c in final.outputs)
        )
        first = request_stat(stats, "first_token_ts")
        last = request_stat(stats, "last_token_ts")
        preemptions = request_stat(stats, "num_preemptions")
        reason = final.outputs[0].finish_reason if final.outputs else None
        self.metrics = m = RequestMetrics(
            submitted=self._submitted,
            scheduled=request_stat(stats, "scheduled_ts"),
            first_token=first or self.first_at,
            last_token=last or (now if self.first_at is not None else None),
            finished=now,
            prompt_tokens=len(final.prompt_token_ids or ()),
            output_tokens=tokens,
            n=max(1, len(final.outputs)),
            preemptions=None if preemptions is None else int(preemptions),
            finish_reason=reason,
            restarts=self.restarts,
        )
        if not enabled(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "prompt_tokens": m.prompt_tokens,
            "output_tokens": m.output_tokens,
            "finish_reason": reason,
            "queue_time": _round(m.queue_time),
            "ttft": _round(m.ttft),
            "mean_itl": _round(m.mean_itl),
            "preemptions": m.preemptions,
        }
        if reason == "abort":
            emit(logging.INFO, "request aborted", why=self.abort_reason or "explicit", **fields)
        else:
            emit(logging.INFO, "request finished", **fields)

    def fail(self, error: BaseException) -> None:
        """Log a request that ended with an exception instead of a final output."""
        if isinstance(error, EngineClosedError):
            emit(logging.INFO, "request aborted", request_id=self.request_id, why="closed")
        elif isinstance(error, EngineDeadError):
            emit(logging.DEBUG, "request failed", request_id=self.request_id, error=str(error))
        else:
            emit(logging.INFO, "request rejected", request_id=self.request_id, error=str(error))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
