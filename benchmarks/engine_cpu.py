"""Where the CPU goes during each driver's run: this process, and each engine process.

A diagnostic for ``bench.py``'s shared mode on the CPU backend, where every
engine's model worker is bound to the same core. It builds the three
engines of ``bench.py`` in one process, then runs raw, AsyncLLM and asynckv
in turn, interleaved, and prints for each run the throughput and the share
of a core that every process used: the main process (all drivers' frontends)
and each engine's core and worker processes, named by the driver they serve.
With ``--no-settle`` a run starts right after the one before, as bench.py
did before its ``settle``: the previous engine's processes then show up
busy in the next driver's run.

``--pin`` runs every repetition twice, once as it is and once with every
thread of this process (all drivers' frontends) kept off the cores the
engines' model workers are bound to, on the cores vLLM's CPU backend
reserves for the frontend (``VLLM_CPU_NUM_OF_RESERVED_CPU``), which vLLM
itself does not hold the frontend to.

Process CPU is read in clock ticks (10 ms): the shares mean something for
runs of a second or more (256 streams and up), not for a smoke run.

``--raw-busy-us X [Y ...]`` adds raw drivers that burn X microseconds of the
main thread per output: how much does the frontend's own CPU cost the
engine's throughput on this machine?

    python benchmarks/engine_cpu.py --concurrency 256 1024 --reps 3
    python benchmarks/engine_cpu.py --concurrency 256 1024 --reps 3 --no-settle
    python benchmarks/engine_cpu.py --concurrency 256 1024 --reps 5 --raw-busy-us 4 8
    python benchmarks/engine_cpu.py --concurrency 256 1024 --reps 12 --pin --quiet
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

import psutil
from bench import DRIVERS, Engines, Workload, process_cpu, run_order, settle
from vllm import LLMEngine
from vllm.inputs import TokensPrompt

from asynckv._worker import _placement as placement


def owners(engines: Engines) -> dict[int, str]:
    """pid -> "driver role" for every engine process ("raw core", "asynckv worker", ...)."""
    me = psutil.Process()
    named = {me.pid: "main"}
    # The children of this process are the engine cores, started in the order the
    # drivers' engines were built (Engines.start); each core's child is its worker.
    # (Other children, such as multiprocessing's resource tracker, are left out by name.)
    cores = sorted(
        (p for p in me.children() if "EngineCore" in p.name()), key=lambda p: p.create_time()
    )
    for driver, core in zip(DRIVERS, cores, strict=False):
        named[core.pid] = f"{driver} core"
        for worker in core.children(recursive=True):
            named[worker.pid] = f"{driver} worker"
    return named


def frontend_cpus() -> set[int]:
    """The CPUs this process may use that no engine worker process is bound to.

    asynckv's own rule (``_placement.py``), over every engine of this process.
    """
    ours = frozenset(os.sched_getaffinity(0))
    cores = [process.pid for process in psutil.Process().children()]
    return set(placement.frontend_cpus(ours, placement.model_worker_cpus(cores, ours)) or ours)


def pin_threads(cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of this process (new threads inherit it)."""
    for thread in psutil.Process().threads():
        try:
            os.sched_setaffinity(thread.id, cpus)
        except OSError:  # ended meanwhile
            continue


def run_raw_busy(engine: LLMEngine, work: Workload, n: int, busy_us: float) -> float:
    """bench.py's raw loop, burning ``busy_us`` of the main thread per output; tok/s."""
    for prompt in work.prompts[:n]:
        prompt_ = TokensPrompt(prompt_token_ids=prompt)
        engine.add_request(uuid.uuid4().hex, prompt_, work.params)
    began, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            end = time.perf_counter() + busy_us * 1e-6
            while time.perf_counter() < end:
                pass
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens / (time.perf_counter() - began)


async def measure(args: argparse.Namespace) -> None:
    engines = Engines.with_defaults(args.concurrency, args.output_len)
    await engines.start()
    names = owners(engines)
    drivers = [*DRIVERS, *(f"raw_busy{x:g}" for x in args.raw_busy_us)]
    every, reserved = set(os.sched_getaffinity(0)), frontend_cpus()
    pins = (False, True) if args.pin else (False,)
    if args.pin:
        print(f"pinned runs: this process on CPUs {sorted(reserved)} of {sorted(every)}")
    try:
        for n in args.concurrency:
            rates: dict[bool, dict[str, list[float]]] = {p: {d: [] for d in drivers} for p in pins}
            for rep in range(args.reps):
                order = pins if rep % 2 == 0 else pins[::-1]
                for pinned, driver in ((p, d) for p in order for d in run_order(drivers, rep)):
                    pin_threads(reserved if pinned else every)
                    if not args.no_settle:
                        await settle(5.0)
                    before, began = process_cpu(), time.perf_counter()
                    if driver.startswith("raw_busy"):
                        busy = float(driver.removeprefix("raw_busy"))
                        rate = run_raw_busy(engines.raw, engines.work, n, busy)
                    else:
                        run = await engines.run(driver, n, probed=False)
                        rate = run.output_tokens / run.seconds
                    seconds, after = time.perf_counter() - began, process_cpu()
                    rates[pinned][driver].append(rate)
                    shares = {
                        names.get(pid, str(pid)): (after[pid] - before.get(pid, 0.0)) / seconds
                        for pid in after
                    }
                    busy_ones = "  ".join(
                        f"{name} {share:.2f}"
                        for name, share in sorted(shares.items(), key=lambda kv: -kv[1])
                        if share >= 0.02
                    )
                    if not args.quiet:
                        label = _label(driver, pinned)
                        print(f"{n:>5} {label:>19} {rate:>8.0f} tok/s | {busy_ones}", flush=True)
            for pinned, by_driver in rates.items():
                medians = {d: statistics.median(v) for d, v in by_driver.items()}
                row = "  ".join(
                    f"{_label(d, pinned)} {m:.0f} ({m / medians['raw']:.3f} x raw)"
                    for d, m in medians.items()
                )
                print(f"{n:>5} medians of {args.reps}: {row}", flush=True)
    finally:
        pin_threads(every)
        await engines.close()


def _label(driver: str, pinned: bool) -> str:
    return f"{driver} pinned" if pinned else driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-settle", action="store_true", help="start each run at once")
    parser.add_argument("--pin", action="store_true", help="also run with this process pinned")
    parser.add_argument("--quiet", action="store_true", help="print the medians only")
    parser.add_argument("--raw-busy-us", type=float, nargs="*", default=[], metavar="US")
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
