"""Measure what a handed-off stream pays: its longest gap between two tokens, against its usual one.

    python benchmarks/handoff.py                      # the tiny model on the CPU, 5 repetitions
    python benchmarks/handoff.py --reps 7 --streams 32 --tokens 256

One pool of two members (``RestartPolicy(max_restarts=0)``, so that requests
keep the state they continue from), built once. Each repetition runs the same
greedy DELTA streams twice, in an order that alternates from one repetition to
the next (ABBA), so that a slow moment of the machine falls on both runs:

* ``baseline``: nothing happens to the streams;
* ``handoff``: once the first stream has ``--at`` tokens, ``pool.drain(0)``
  moves member 0's unfinished streams to member 1, where each continues from
  its last token (then ``readmit(0)``).

Every stream's outputs are stamped on arrival (``time.perf_counter`` on the
consumer's loop, what a client sees); its gaps are the times between two
outputs after the first (time to first token excluded). Per stream: the
usual gap (the median), the longest, and their ratio. Per run and group (the
streams that moved, the adopting member's own streams, and all streams of the
baseline run), the median over the group's streams. The summary gives the
median over the repetitions of each figure: the moved streams' extra pause
(longest gap less usual gap) is the cost of a hand-over; the adopter's own
streams show what taking the moved ones in costs them (a step that prefills
the moved streams' prompts and tokens so far); the baseline's ratio is what
the longest gap is with nothing moved (the machine's own jitter).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import EngineArgs, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEnginePool, RequestStream, RestartPolicy
from asynckv.testing import tiny_model

GROUPS = ("moved", "adopter", "baseline")


@dataclass
class Stamped:
    """One stream's output arrival times, and how many tokens each output held."""

    rid: str
    times: list[float] = field(default_factory=list)
    tokens: int = 0

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times[1:], self.times[2:], strict=False)]


@dataclass(frozen=True)
class Gaps:
    """A group's figures in one run: medians over its streams, in milliseconds."""

    streams: int
    usual: float
    longest: float

    @property
    def ratio(self) -> float:
        return self.longest / self.usual

    @property
    def pause(self) -> float:
        return self.longest - self.usual


def group(stamped: list[Stamped]) -> Gaps:
    usual = [statistics.median(s.gaps()) * 1e3 for s in stamped]
    longest = [max(s.gaps()) * 1e3 for s in stamped]
    return Gaps(len(stamped), statistics.median(usual), statistics.median(longest))


async def consume(stream: RequestStream, stamped: Stamped, tokens: asyncio.Event, at: int) -> None:
    async for out in stream:
        stamped.times.append(time.perf_counter())
        stamped.tokens += len(out.outputs[0].token_ids)
        if stamped.tokens >= at:
            tokens.set()


def prompts(opts: argparse.Namespace, seed: int) -> list[TokensPrompt]:
    """Prompts of random token ids, new for every run: no prefix cached from an earlier one."""
    rng = random.Random(seed)
    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(100, 500) for _ in range(opts.prompt)])
        for _ in range(opts.streams)
    ]


async def run(
    pool: AsyncEnginePool, opts: argparse.Namespace, handoff: bool, rep: int
) -> dict[str, Gaps]:
    """One run of fresh prompts as greedy DELTA streams; with ``handoff``, drain member 0."""
    tokens, at = opts.tokens, opts.at
    params = SamplingParams(
        max_tokens=tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    mode = "handoff" if handoff else "baseline"
    fresh = prompts(opts, seed=2 * rep + handoff)
    stamped = [Stamped(f"{mode}-{rep}-{i}") for i in range(len(fresh))]
    streams = [pool.generate(p, params, s.rid) for p, s in zip(fresh, stamped, strict=True)]
    homes = [pool.engine_of(s.rid) for s in stamped]
    reached = asyncio.Event()
    consumers = [
        asyncio.create_task(consume(stream, s, reached, at))
        for stream, s in zip(streams, stamped, strict=True)
    ]
    moved: set[str] = set()
    if handoff:
        await reached.wait()
        drained = await pool.drain(0)
        pool.readmit(0)
        moved = set(drained.moved)
    await asyncio.gather(*consumers)
    assert all(s.tokens == tokens for s in stamped), [s.tokens for s in stamped]
    if not handoff:
        return {"baseline": group(stamped)}
    return {
        "moved": group([s for s in stamped if s.rid in moved]),
        "adopter": group([s for s, home in zip(stamped, homes, strict=True) if home == 1]),
    }


async def main(opts: argparse.Namespace) -> None:
    settings: dict[str, Any] = {
        "model": opts.model or str(tiny_model()),
        "max_model_len": 512,
        "max_num_seqs": max(32, opts.streams),
        "seed": 0,
        "disable_log_stats": True,
        "enforce_eager": not opts.compiled,
    }
    if opts.gpu_memory_utilization is not None:  # two members on one GPU
        settings["gpu_memory_utilization"] = opts.gpu_memory_utilization
    args = EngineArgs(**settings)
    pool = AsyncEnginePool.from_engine_args([args, args], restart=RestartPolicy(max_restarts=0))
    async with pool:
        await run(pool, opts, True, -1)  # warm-up, not counted
        results: dict[str, list[Gaps]] = {g: [] for g in GROUPS}
        for rep in range(opts.reps):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for handoff in order:
                figures = await run(pool, opts, handoff, rep)
                for name, gaps in figures.items():
                    results[name].append(gaps)
                    print(
                        f"rep {rep} {name:>8}: {gaps.streams:>3} streams, usual gap "
                        f"{gaps.usual:6.1f} ms, longest {gaps.longest:7.1f} ms, "
                        f"ratio {gaps.ratio:5.1f}",
                        flush=True,
                    )
    print(
        f"\nmedians over {opts.reps} repetitions ({opts.streams} streams of {opts.tokens} "
        f"tokens, drain at {opts.at} tokens):"
    )
    for name in GROUPS:
        runs = results[name]
        print(
            f"  {name:>8}: usual gap {statistics.median(g.usual for g in runs):6.1f} ms, "
            f"longest {statistics.median(g.longest for g in runs):7.1f} ms, "
            f"ratio {statistics.median(g.ratio for g in runs):5.1f} "
            f"(per rep {', '.join(f'{g.ratio:.1f}' for g in runs)}), "
            f"extra pause {statistics.median(g.pause for g in runs):7.1f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions (each: both runs)")
    parser.add_argument("--streams", type=int, default=16, help="streams per run")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    parser.add_argument("--at", type=int, default=32, help="drain once a stream has this many")
    parser.add_argument("--model", default=None, help="a checkpoint (default: the tiny model)")
    parser.add_argument("--compiled", action="store_true", help="vLLM's default, not eager")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    asyncio.run(main(parser.parse_args()))
