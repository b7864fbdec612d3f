"""Reset the prefix cache in the middle of generation, on asynckv's AsyncEngine, under trio.

The same program as ``reset_kv_async.py``, written for trio: the same
schedule (request ``i`` added right after step ``i``, the prefix cache reset
right after step 10), the same report and the same printed output, with
trio's structured concurrency in place of asyncio tasks. One nursery task per
request consumes that request's stream, and the reset runs in a cancel scope
of its own that is cancelled if every request finishes before step 10 (the
worker steps only while requests are unfinished, so that step would never
come). Only the concurrency differs; the prompts, the engine and the
formatting are ``reset_kv_async``'s own.

Run it as the asyncio one::

    python examples/reset_kv_trio.py
    python examples/reset_kv_trio.py --model /models/Qwen3-0.6B --max-model-len 2048
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence

import trio
from vllm import EngineArgs, SamplingParams

from asynckv import AsyncEngine, RequestStream
from reset_kv_async import (
    RESET_AT_STEP,
    Report,
    RequestReport,
    ResetReport,
    build_engine,
    format_output,
    format_summary,
    parse_args,
    prompts,
)


async def run(
    args: argparse.Namespace,
    *,
    reset_at_step: int | None = RESET_AT_STEP,
    echo: Callable[[str], None] = print,
) -> Report:
    """Run the schedule on a new engine built from ``args`` and report what happened.

    As ``reset_kv_async.run``, in a trio run.
    """
    engine_args = EngineArgs.from_cli_args(args)
    # Building takes a while: off the run, which could be serving meanwhile.
    llm_engine = await trio.to_thread.run_sync(build_engine, engine_args)
    todo = prompts()
    reports: list[RequestReport | None] = [None] * len(todo)
    reset = ResetReport()
    # AsyncEngine owns it from here; leaving the block shuts the engine down,
    # even when a cancellation leaves it (the close is shielded).
    async with AsyncEngine(llm_engine) as engine:
        base = engine.step_count
        started = time.monotonic()
        streams: dict[str, RequestStream] = {}

        async def consume(rid: str, stream: RequestStream, added_at: int) -> RequestReport:
            report: RequestReport | None = None
            async for out in stream:
                seconds = time.monotonic() - started
                if report is None:
                    report = RequestReport(rid, added_at, out, seconds, seconds)
                report.output, report.last_token_s = out, seconds
            assert report is not None  # a stream yields its final output at least
            metrics = stream.metrics
            if metrics and metrics.first_token is not None and metrics.last_token is not None:
                report.first_token_s = metrics.first_token - started
                report.last_token_s = metrics.last_token - started
            report.running_at_reset = rid in reset.running
            echo(format_output(report.output))
            return report

        async def add(index: int, prompt: str, params: SamplingParams) -> None:
            rid = str(index)
            async with engine.paused(at_step=base + index):
                streams[rid] = stream = engine.generate(prompt, params, request_id=rid)
            reports[index] = await consume(rid, stream, index)

        async def reset_cache(at: int, scope: trio.CancelScope) -> None:
            with scope:
                async with engine.paused(at_step=base + at) as step:
                    reset.running = [rid for rid, s in streams.items() if not s.finished]
                    reset.result = await engine.reset_prefix_cache(reset_running_requests=True)
                    reset.step, reset.seconds = step - base, time.monotonic() - started

        async with trio.open_nursery() as nursery:
            reset_scope = trio.CancelScope()
            if reset_at_step is not None:
                nursery.start_soon(reset_cache, reset_at_step, reset_scope)
            # All the holds are placed before any is reached: the tasks started
            # here all run up to awaiting their boundary in one scheduler batch.
            async with trio.open_nursery() as requests:
                for index, (prompt, params) in enumerate(todo):
                    requests.start_soon(add, index, prompt, params)
            reset_scope.cancel()  # a no-op if the reset has run
    done = [r for r in reports if r is not None]
    assert len(done) == len(reports)  # a request that failed raised out of the nursery
    report = Report(done, reset)
    echo(format_summary(report, reset_at_step))
    return report


def main(argv: Sequence[str] | None = None, echo: Callable[[str], None] = print) -> Report:
    """Parse the command line, run the program under trio, print what happens, return its report."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = parse_args(argv)
    report: Report = trio.run(functools.partial(run, args, echo=echo))
    return report


if __name__ == "__main__":  # vLLM spawns engine processes: the guard is required
    main()
