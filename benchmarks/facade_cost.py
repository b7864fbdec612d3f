"""The facade's own CPU per output, with the engine taken out of the picture.

A fake engine that costs almost nothing stands in for ``LLMEngine``: it
runs up to 256 requests, gives each one token per step, and sleeps
``--step-ms`` inside ``step()`` (releasing the GIL, as the real engine does
while its core computes), so the loop drains every step's outputs before the
next one, as it does on a real engine. The garbage collector is off while a
repetition runs, so that what is measured is the facade's own instructions,
not whichever thread a collection happened to start in.

Prints, per repetition and as medians, the event loop thread's CPU per
output (delivery, the stream, the consumer's ``async for``) and the worker
thread's CPU per output outside ``step()`` (dispatch and the outbox).
Thread CPU times, not wall time, so a loaded machine changes them little;
still compare only figures from one run, or one run per version back to back.

    python benchmarks/facade_cost.py --streams 1024 --reps 7
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine


class CheapEngine:
    """One token per running request per step; ``step()`` sleeps ``pause`` seconds."""

    def __init__(self, running: int, pause: float) -> None:
        self.running = running
        self.pause = pause
        self.active: dict[str, list[int]] = {}
        self.queue: list[tuple[str, int]] = []
        self.step_cpu = 0.0  # thread CPU spent inside step(), to subtract
        self.output_processor = SimpleNamespace(external_req_ids={}, request_states={})
        self.engine_core = SimpleNamespace(shutdown=lambda: None)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, **_: Any) -> None:
        self.queue.append((request_id, params.max_tokens or 16))

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.active.pop(rid, None)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.active or self.queue)

    def get_num_unfinished_requests(self) -> int:
        return len(self.active) + len(self.queue)

    def step(self) -> list[RequestOutput]:
        began = time.thread_time()
        while self.queue and len(self.active) < self.running:
            rid, limit = self.queue.pop(0)
            self.active[rid] = [0, limit]
        outputs = []
        for rid, state in list(self.active.items()):
            state[0] += 1
            done = state[0] >= state[1]
            reason = "length" if done else None
            completion = CompletionOutput(0, "x", [state[0]], None, None, reason)
            outputs.append(RequestOutput(rid, None, [1], None, [completion], done))
            if done:
                del self.active[rid]
        self.step_cpu += time.thread_time() - began
        time.sleep(self.pause)
        return outputs


def _thread_cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


async def run(streams: int, reps: int, tokens: int, pause: float) -> None:
    fake = CheapEngine(256, pause)
    engine = AsyncEngine(fake, freeze_gc=False)  # type: ignore[arg-type]  # a stand-in
    await engine.start()
    worker = engine._worker._thread  # the benchmark's one look inside: whose CPU to read
    params = SamplingParams(max_tokens=tokens, output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> int:
        count = 0
        async for out in engine.generate("x", params, f"{i}-{time.perf_counter_ns()}"):
            count += len(out.outputs[0].token_ids)
        return count

    rows: list[tuple[float, float]] = []
    try:
        for rep in range(reps):
            gc.collect()
            gc.disable()
            try:
                fake.step_cpu = 0.0
                loop0, worker0 = time.thread_time(), _thread_cpu(worker)
                got = sum(await asyncio.gather(*(one(i) for i in range(streams))))
                loop_cpu = time.thread_time() - loop0
                worker_cpu = _thread_cpu(worker) - worker0 - fake.step_cpu
            finally:
                gc.enable()
            assert got == streams * tokens, f"lost tokens: {got} of {streams * tokens}"
            rows.append((loop_cpu / got * 1e6, worker_cpu / got * 1e6))
            print(f"rep {rep}: loop {rows[-1][0]:.3f} us/output, worker {rows[-1][1]:.3f}")
    finally:
        await engine.aclose()
    loop_us = statistics.median(r[0] for r in rows)
    worker_us = statistics.median(r[1] for r in rows)
    print(f"median of {reps}: loop {loop_us:.3f} us/output, worker (outside step) {worker_us:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=3.0)
    args = parser.parse_args()
    asyncio.run(run(args.streams, args.reps, args.tokens, args.step_ms / 1000))


if __name__ == "__main__":
    main()
