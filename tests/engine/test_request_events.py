"""Per-request log events and metrics over the real engine: finished, aborted, cancelled, preempted.

The logs and stats over the fake engine (a death, a stall, scripted counts) are
in tests/fake/test_observability.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from vllm import SamplingParams
from vllm.v1.metrics.stats import RequestStateStats

from asynckv import AsyncEngine
from support import cancel_while_iterating

# vLLM 0.26 (the GPU run's) doesn't count preemptions: then the count is unknown, not 0.
COUNTS_PREEMPTIONS = hasattr(RequestStateStats(), "num_preemptions")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def events_of(logs: list[MutableMapping[str, Any]], request_id: str) -> list[str]:
    return [e["event"] for e in logs if e.get("request_id") == request_id]


async def test_finished_request_events_and_metrics(
    engine: AsyncEngine, logs: list[MutableMapping[str, Any]]
) -> None:
    """A finished request logs added, first token, finished; its metrics add up."""
    stream = engine.generate("Metrics, please", GREEDY)
    out = await stream
    assert events_of(logs, stream.request_id) == [
        "request added",
        "first token",
        "request finished",
    ]
    (finished,) = [e for e in logs if e["event"] == "request finished"]
    assert finished["output_tokens"] == 8
    assert finished["finish_reason"] == "length"
    assert finished["prompt_tokens"] == len(out.prompt_token_ids or [])
    assert finished["log_level"] == "info"
    m = stream.metrics
    assert m is not None and m.output_tokens == 8
    assert m.preemptions == (0 if COUNTS_PREEMPTIONS else None)
    assert m.ttft is not None and m.ttft >= 0
    assert m.first_token is not None and m.last_token is not None
    assert m.last_token >= m.first_token


async def test_aborted_and_cancelled_request_events(
    engine: AsyncEngine, logs: list[MutableMapping[str, Any]]
) -> None:
    """An explicit abort and a cancelled consumer log "request aborted" with why."""
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    explicit = engine.generate("abort me", long)
    await engine.run_on_engine(lambda e: None)
    await engine.abort(explicit.request_id)
    await explicit

    cancelled = engine.generate("cancel me", long)
    await cancel_while_iterating(cancelled)
    await engine.run_on_engine(lambda e: None)
    await asyncio.sleep(0)  # the abort output reaches the loop in the pass's batch

    aborted = {e["request_id"]: e for e in logs if e["event"] == "request aborted"}
    assert aborted[explicit.request_id]["why"] == "explicit"
    assert aborted[cancelled.request_id]["why"] == "cancelled"


async def test_reset_preempted_request_events(
    engine: AsyncEngine, logs: list[MutableMapping[str, Any]]
) -> None:
    """A reset of running requests logs its result, step and preemptions; the request finishes."""
    stream = engine.generate("preempt me " * 10, SamplingParams(max_tokens=30, ignore_eos=True))
    async with engine.paused(at_step=engine.step_count + 3) as step:
        assert await engine.reset_prefix_cache(reset_running_requests=True)
    out = await stream
    (reset,) = [e for e in logs if e["event"] == "prefix cache reset"]
    assert reset["result"] is True and reset["step"] == step
    assert reset["requests_preempted"] == 1
    assert events_of(logs, stream.request_id)[-1] == "request finished"
    assert len(out.outputs[0].token_ids) == 30
    assert stream.metrics is not None
    assert stream.metrics.preemptions == (1 if COUNTS_PREEMPTIONS else None)
