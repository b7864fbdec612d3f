"""What keeping asynckv's worker off the model cores is worth: the same engine, both ways.

On vLLM's CPU backend the model worker is bound to some cores and the rest are
left to the frontend; asynckv keeps its worker thread and vLLM's output thread
there (``keep_off_model_cores``, ``_placement.py``). This builds ``bench.py``'s
raw and asynckv engines in one process and runs, interleaved and settled as
``bench.py`` does: raw; asynckv as it is; and asynckv with the placement
switched off for the run, its threads on every CPU (what it did before).
Prints the medians and each one's ratio to raw.

    python benchmarks/placement.py --concurrency 256 1024 --reps 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from bench import Engines, calibrate, run_order, settle


async def measure(args: argparse.Namespace) -> None:
    engines = Engines.with_defaults(args.concurrency, args.output_len)
    await engines.start()
    placement = engines.kv._worker.placement  # the one look inside: switched between runs
    frontend = placement.frontend
    if frontend is None:
        print("nothing to place: no model worker is bound to a subset of our CPUs")
        await engines.close()
        return
    every = sorted(os.sched_getaffinity(0))
    print(f"under load the worker goes to CPUs {sorted(frontend)} of {every}")
    drivers = ["raw", "asynckv", "asynckv_unplaced"]
    try:
        for n in args.concurrency:
            rates: dict[str, list[float]] = {d: [] for d in drivers}
            bursts = await calibrate(engines, n, engines.args)  # runs as long as bench.py's
            for rep in range(args.reps):
                for driver in run_order(drivers, rep):
                    # Between runs nothing is in flight, so the threads are on every CPU;
                    # without a frontend the worker leaves them there for the run.
                    placement.frontend = None if driver.endswith("unplaced") else frontend
                    await settle(5.0)
                    run = await engines.run(
                        driver.removesuffix("_unplaced"), n, probed=False, bursts=bursts
                    )
                    rates[driver].append(run.output_tokens / run.seconds)
            raw = statistics.median(rates["raw"])
            row = "  ".join(
                f"{d} {statistics.median(v):.0f} ({statistics.median(v) / raw:.3f} x raw)"
                for d, v in rates.items()
            )
            print(f"{n:>5} medians of {args.reps}: {row}", flush=True)
    finally:
        placement.frontend = frontend
        await engines.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--output-len", type=int, default=64)
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
