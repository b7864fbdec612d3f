"""Reset the prefix cache in the middle of generation, on asynckv's AsyncEngine.

vLLM's reset-KV example drives a synchronous ``LLMEngine`` by hand: it adds
one of four prompts before each of the first engine steps, resets the prefix
cache (preempting the running requests) before step 11, and prints every
finished output. This is the same program on ``AsyncEngine``: the engine
steps on its own thread, one task per request consumes that request's stream,
and ``engine.paused(at_step=k)`` puts each addition, and the reset, at the
same step boundary as the original.

Run it with no arguments to use asynckv's demo model (a tiny Llama that has
memorised a few public-domain texts; built and cached on first use, offline),
or give any vLLM engine flag, such as ``--model PATH`` for a local checkpoint::

    python examples/reset_kv_async.py
    python examples/reset_kv_async.py --model /models/Qwen3-0.6B --max-model-len 2048
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.outputs import RequestOutput
from vllm.utils.argparse_utils import FlexibleArgumentParser

from asynckv import AsyncEngine, RequestStream

RESET_AT_STEP = 10
"""The reset runs at the boundary right after this many steps, as in the original."""


def prompts() -> list[tuple[str, SamplingParams]]:
    """The original's four prompts (five requests), in the order they are added."""
    robot = "A robot may not injure a human being " * 50
    greedy = SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16)
    return [
        # Twice the same greedy request: the second one hits the prefix cache.
        (robot, greedy),
        (robot, greedy.clone()),
        (
            "To be or not to be,",
            SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=128),
        ),
        (
            "What is the meaning of life?",
            SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1, max_tokens=128),
        ),
    ]


@dataclass
class RequestReport:
    """What happened to one request."""

    request_id: str
    added_at_step: int
    output: RequestOutput
    """Its final output: every completion, with token ids and text."""
    first_token_s: float
    """Seconds from the start of the run to its first token."""
    last_token_s: float
    """Seconds from the start of the run to its last token."""
    running_at_reset: bool = False
    """Whether it was unfinished when the prefix cache was reset."""


@dataclass
class ResetReport:
    """The prefix-cache reset: whether it ran, its result and where."""

    result: bool | None = None
    """``reset_prefix_cache``'s answer; None if it never ran (all requests were done)."""
    step: int | None = None
    """Engine steps done when it ran."""
    seconds: float | None = None
    """Seconds from the start of the run to the reset."""
    running: list[str] = field(default_factory=list)
    """Ids of the requests unfinished at that moment."""


@dataclass
class Report:
    """The outcome of one run of the program."""

    requests: list[RequestReport]
    """One per request, in the order they were added."""
    reset: ResetReport


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse vLLM's engine flags (``EngineArgs.add_cli_args``); no ``--model``: the demo model."""
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)
    args: argparse.Namespace = parser.parse_args(argv)
    if args.model is None:
        from asynckv.testing import demo_model

        args.model = str(demo_model())
    return args


def build_engine(engine_args: EngineArgs) -> LLMEngine:
    """Build an ``LLMEngine`` whose engine core runs in this process.

    The schedule counts engine steps. With vLLM's default engine-core process,
    the core steps on its own and runs ahead of ``LLMEngine.step()``, so "right
    after step 10" would land a few core steps later, and a request the loop
    still sees running could already be finished in the core. In-process, each
    ``step()`` is exactly one core step, as the original example assumes.
    """
    from vllm.v1.executor import Executor

    config = engine_args.create_engine_config()
    return LLMEngine(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=not engine_args.disable_log_stats,
        multiprocess_mode=False,
    )


async def run(
    args: argparse.Namespace,
    *,
    reset_at_step: int | None = RESET_AT_STEP,
    echo: Callable[[str], None] = print,
) -> Report:
    """Run the schedule on a new engine built from ``args`` and report what happened.

    Request ``i`` is added at the boundary right after step ``i``, and the
    prefix cache is reset (preempting running requests) right after step
    ``reset_at_step``, or never if it is None. Each finished output is echoed
    as it arrives.
    """
    engine_args = EngineArgs.from_cli_args(args)
    # Building takes a while: off the loop, which could be serving meanwhile.
    llm_engine = await asyncio.to_thread(build_engine, engine_args)
    # AsyncEngine owns it from here: its worker thread is the only caller of
    # the engine, and leaving the block shuts the engine down.
    async with AsyncEngine(llm_engine) as engine:
        base = engine.step_count
        started = time.monotonic()
        streams: dict[str, RequestStream] = {}
        reset = ResetReport()

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
                # The engine's own timestamps (same clock) are closer to the
                # truth than when the outputs reached this loop.
                report.first_token_s = metrics.first_token - started
                report.last_token_s = metrics.last_token - started
            report.running_at_reset = rid in reset.running
            echo(format_output(report.output))
            return report

        async def add(rid: str, prompt: str, params: SamplingParams, at: int) -> RequestReport:
            async with engine.paused(at_step=base + at):
                streams[rid] = stream = engine.generate(prompt, params, request_id=rid)
            return await consume(rid, stream, at)

        async def reset_cache(at: int) -> None:
            async with engine.paused(at_step=base + at) as step:
                reset.running = [rid for rid, s in streams.items() if not s.finished]
                reset.result = await engine.reset_prefix_cache(reset_running_requests=True)
                reset.step, reset.seconds = step - base, time.monotonic() - started

        # All the holds are placed before any is reached: each task's first
        # stretch (up to awaiting its boundary) runs in this same loop pass.
        requests = [
            asyncio.create_task(add(str(i), prompt, params, at=i))
            for i, (prompt, params) in enumerate(prompts())
        ]
        resetter = (
            None if reset_at_step is None else asyncio.create_task(reset_cache(reset_at_step))
        )
        reports = await asyncio.gather(*requests)
        if resetter is not None:
            # The worker steps only while requests are unfinished: if all of
            # them finished before the reset's step, that step never comes.
            if not resetter.done():
                resetter.cancel()
            await asyncio.gather(resetter, return_exceptions=True)
    report = Report(reports, reset)
    echo(format_summary(report, reset_at_step))
    return report


def format_output(out: RequestOutput) -> str:
    """Describe a finished output: one line per completion, with its text."""
    lines = [f"request {out.request_id} finished ({len(out.prompt_token_ids or [])} prompt tokens)"]
    for c in out.outputs:
        logprob = "" if c.cumulative_logprob is None else f", logprob {c.cumulative_logprob:.2f}"
        lines.append(
            f"  completion {c.index}: {len(c.token_ids)} tokens, {c.finish_reason}{logprob}:"
            f" {c.text!r}"
        )
    return "\n".join(lines)


def format_summary(report: Report, reset_at_step: int | None) -> str:
    """Tabulate when each request got its tokens and what the reset did."""

    lines = ["", "request  added at step  first token  last token  running at reset"]
    for r in report.requests:
        lines.append(
            f"{r.request_id:>7}  {r.added_at_step:13d}  {r.first_token_s:9.2f} s"
            f"  {r.last_token_s:8.2f} s  {'yes' if r.running_at_reset else 'no'}"
        )
    reset = report.reset
    if reset_at_step is None:
        lines.append("reset: not requested")
    elif reset.result is None or reset.seconds is None:
        lines.append(f"reset: not run (every request finished before step {reset_at_step})")
    else:
        lines.append(
            f"reset: reset_prefix_cache(reset_running_requests=True) returned {reset.result}"
            f" at step {reset.step} ({reset.seconds:.2f} s),"
            f" with {len(reset.running)} requests running: {', '.join(reset.running) or '-'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, echo: Callable[[str], None] = print) -> Report:
    """Parse the command line, run the program, print what happens and return its report."""
    # vLLM on CPUs needs a KV-cache size; 1 GiB is plenty here.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return asyncio.run(run(parse_args(argv), echo=echo))


if __name__ == "__main__":  # vLLM spawns engine processes: the guard is required
    main()
