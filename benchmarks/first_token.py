"""Where a first token waits: generate() -> inbox -> add_request -> core -> loop -> consumer.

Runs bursts of N streams through asynckv (and the raw ``LLMEngine`` loop
for the engine-side phases) and stamps every request at each hand-off, by
wrapping the calls on this process's objects only (a probe, not a patch of
asynckv): ``AsyncEngine.generate`` (the loop's call), the worker's
``Inbox.take`` (the pass that took the command), ``LLMEngine.add_request``
(input processing on the worker), ``LLMEngine.step`` (the step whose
outputs hold the request's first token), ``_Sink.push`` (its delivery on
the loop) and the consumer's first ``anext``. Prints, per size, the median
and p90 of each phase over the burst, in ms, and the burst's totals.

    python benchmarks/first_token.py --concurrency 64 256 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import itertools

from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.inputs import TokensPrompt

from asynckv import AsyncEngine
from asynckv._loop._stream import _Sink
from asynckv.testing import tiny_model

PHASES = ("loop", "inbox", "pass", "add", "core", "deliver", "wake", "ttft")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 200) for _ in range(rng.randint(32, 128))] for _ in range(n)]


class Stamps:
    """Per request id: the time of each hand-off (perf_counter)."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}

    def mark(self, rid: str, what: str) -> None:
        self.at.setdefault(rid, {}).setdefault(what, time.perf_counter())

    def phases(self) -> dict[str, list[float]]:
        order = ["call", "submitted", "taken", "add0", "add1", "stepped", "pushed", "received"]
        out: dict[str, list[float]] = {p: [] for p in PHASES}
        for marks in self.at.values():
            if not all(k in marks for k in order):
                continue
            t = [marks[k] for k in order]
            for name, (a, b) in zip(PHASES, itertools.pairwise(t), strict=False):
                out[name].append((b - a) * 1e3)
            out["ttft"].append((marks["received"] - marks["call"]) * 1e3)
        return out


def instrument(kv: AsyncEngine, llm: Any, stamps: Stamps) -> None:
    """Wrap the hand-offs of this engine (this process only)."""
    generate = kv.generate

    def gen(prompt: Any, params: Any = None, request_id: Any = None, **kw: Any) -> Any:
        stamps.mark(request_id, "call")
        stream = generate(prompt, params, request_id, **kw)
        stamps.mark(request_id, "submitted")
        return stream

    kv.generate = gen  # type: ignore[method-assign,assignment]
    inbox = kv._worker.inbox
    take = inbox.take

    def took(block: bool, timeout: float | None = None) -> Any:
        items = take(block, timeout)
        for item in items:
            rid = getattr(item, "request_id", None)
            if rid is not None:
                stamps.mark(rid, "taken")
        return items

    inbox.take = took  # type: ignore[method-assign]
    _wrap_engine(llm, stamps)
    push = _Sink.push

    def pushed(self: _Sink, out: Any) -> None:
        stamps.mark(self.request_id, "pushed")
        push(self, out)

    _Sink.push = pushed  # type: ignore[method-assign]


def _wrap_engine(llm: Any, stamps: Stamps) -> None:
    add, step = llm.add_request, llm.step

    def added(rid: str, *args: Any, **kw: Any) -> Any:
        stamps.mark(rid, "add0")
        try:
            return add(rid, *args, **kw)
        finally:
            stamps.mark(rid, "add1")

    def stepped() -> Any:
        outputs = step()
        for out in outputs:
            stamps.mark(out.request_id, "stepped")
        return outputs

    llm.add_request, llm.step = added, stepped


async def burst_kv(
    kv: AsyncEngine, prompts: list[list[int]], params: SamplingParams, stamps: Stamps
) -> float:
    async def one(prompt: list[int]) -> None:
        rid = uuid.uuid4().hex
        first = True
        async for _ in kv.generate(TokensPrompt(prompt_token_ids=prompt), params, rid):
            if first:
                stamps.mark(rid, "received")
                first = False

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0


def burst_raw(llm: Any, prompts: list[list[int]], params: SamplingParams, stamps: Stamps) -> float:
    t0 = time.perf_counter()
    for prompt in prompts:
        rid = uuid.uuid4().hex
        stamps.mark(rid, "call")
        stamps.mark(rid, "submitted")
        stamps.mark(rid, "taken")
        llm.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    while llm.has_unfinished_requests():
        for out in llm.step():
            stamps.mark(out.request_id, "pushed")
            stamps.mark(out.request_id, "received")
    return time.perf_counter() - t0


def report(name: str, n: int, runs: list[dict[str, list[float]]]) -> None:
    cells = []
    for phase in PHASES:
        p50 = statistics.median(statistics.median(r[phase]) for r in runs if r[phase])
        p90 = statistics.median(
            sorted(r[phase])[int(0.9 * len(r[phase]))] for r in runs if r[phase]
        )
        cells.append(f"{phase} {p50:.2f}/{p90:.2f}")
    print(f"{name:>7} n={n:>5}: " + " | ".join(cells), flush=True)


async def main_async(args: argparse.Namespace) -> None:
    settings: dict[str, Any] = {
        "model": str(tiny_model()),
        "max_model_len": 512,
        "seed": 0,
        "disable_log_stats": True,
        "max_num_seqs": 256,
    }
    raw = LLMEngine.from_engine_args(EngineArgs(**settings))
    kv = AsyncEngine.from_engine_args(EngineArgs(**settings))
    await kv.start()
    llm_kv = await kv.run_on_engine(lambda e: e)
    kv_stamps, raw_stamps = Stamps(), Stamps()
    instrument(kv, llm_kv, kv_stamps)
    _wrap_engine(raw, raw_stamps)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    try:
        for n in args.concurrency:
            prompts = _prompts(n)
            kv_runs, raw_runs = [], []
            for _ in range(args.reps):
                raw_stamps.at.clear()
                burst_raw(raw, prompts, params, raw_stamps)
                raw_runs.append(raw_stamps.phases())
                kv_stamps.at.clear()
                await burst_kv(kv, prompts, params, kv_stamps)
                kv_runs.append(kv_stamps.phases())
            report("raw", n, raw_runs)
            report("asynckv", n, kv_runs)
    finally:
        await kv.aclose()
        raw.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=16)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
