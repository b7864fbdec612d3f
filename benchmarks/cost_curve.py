"""The cost curve: how asynckv's costs grow with the number of requests (issue 16, item 6).

Two parts. ``measure`` runs here, on one in-process engine (``multiprocess_mode=False``:
the engine core steps only when the worker calls ``step()``, so a held engine computes
nothing while requests pile up), and writes a JSON file:

- **submission**: ``--requests`` (10,000) ``generate()`` calls in a row on the loop, with
  stepping held by ``engine.paused()``. *accepted*: until the last call returns (every
  request in the worker's inbox); *admitted*: until a marker command sent after them is
  answered (the inbox is FIFO, so every request has been through ``add_request``).
  The floor, *raw*: the same ``add_request`` calls in one tight loop on the worker thread
  (through ``run_on_engine``, on the same engine), nothing else running. Every burst is
  aborted afterwards (not timed). Repetitions interleaved, raw then asynckv.
- **memory** per request, with ``tracemalloc`` (Python allocations only: no tensors, and
  the KV cache is allocated up front anyway), at each of ``--memory-sizes``: *parked*:
  N requests submitted while ``pause_generation()`` keeps them out of the engine, so
  everything allocated is the facade's (stream, sink, command, the parked tuple);
  *admitted*: the same N admitted into the held engine, nothing stepped; *after*: once
  all are aborted, their streams awaited and dropped (what is left: a leak). Each live
  allocation is charged to the innermost frame of its traceback that is in asynckv's
  or vLLM's source (else "other"; this script's own list of streams is "harness").
  vLLM's part is split into its engine core (``vllm/v1/core/``, ``vllm/v1/request.py``,
  ``vllm/v1/engine/core.py``: in vLLM's default multiprocess mode that lives in the
  core's process, not the caller's) and its client side (the rest: input and output
  processing, which stay in the caller's process in both modes).

``plot`` draws the curve from ``benchmarks/bench.py`` JSONs, their sizes merged (tok/s,
TTFT p50, loop lag p99, CPU per 1,000 tokens and each thread's share, at every size they
ran), and prints the tables of docs/performance.md. *Facade share* of the main process's
CPU is what a driver spends per token beyond the raw ``LLMEngine`` loop, over what it
spends: ``1 - raw / driver`` of the CPU seconds per 1,000 tokens (the engine's own
client-side work, input and output processing, is in raw's figure and in every driver's).

    python benchmarks/cost_curve.py measure --out results/cost
    python benchmarks/bench.py --mode separate --concurrency 1 16 64 256 1024 4096 \
        --reps 5 --stream-interval 50 --no-consumers --out results/cpu-sep
    python benchmarks/cost_curve.py plot results/cpu-sep.json results/cost.json \
        --out docs/img/cpu-cost-curve.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import asynckv

HERE = os.path.abspath(__file__)
ASYNCKV_DIR = os.path.dirname(os.path.abspath(asynckv.__file__)) + os.sep
CORE_PARTS = (f"vllm{os.sep}v1{os.sep}core{os.sep}", "vllm/v1/request.py", "vllm/v1/engine/core.py")


def _prompts(n: int, vocab: int, seed: int = 0) -> list[Any]:
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    return [
        TokensPrompt(
            prompt_token_ids=[rng.randrange(4, vocab) for _ in range(rng.randint(32, 128))]
        )
        for _ in range(n)
    ]


def _build(args: argparse.Namespace) -> asynckv.AsyncEngine:
    """An in-process engine of the tiny model (or --model), wrapped: the worker starts now."""
    from vllm import EngineArgs, LLMEngine
    from vllm.v1.executor import Executor

    from asynckv.testing import tiny_model

    settings: dict[str, Any] = {
        "model": args.model or str(tiny_model()),
        "max_model_len": 512,
        "max_num_seqs": 256,
        "seed": 0,
        "disable_log_stats": True,
    }
    if args.load_format:
        settings |= {"load_format": args.load_format, "skip_tokenizer_init": True}
    if args.gpu_memory_utilization is not None:
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        settings["enforce_eager"] = True
    config = EngineArgs(**settings).create_engine_config()
    engine = LLMEngine(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
        multiprocess_mode=False,
    )
    return asynckv.AsyncEngine(engine)


# -- submission ------------------------------------------------------------------------


async def _raw_burst(kv: asynckv.AsyncEngine, prompts: list[Any], params: Any) -> float:
    ids = [f"raw-{i}" for i in range(len(prompts))]

    def burst(engine: Any) -> float:
        # On the worker thread, between two steps: the engine's own add_request, back to back.
        began = time.perf_counter()
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        seconds = time.perf_counter() - began
        engine.abort_request(ids)
        return seconds

    async with kv.paused():
        return await kv.run_on_engine(burst)


async def _kv_burst(
    kv: asynckv.AsyncEngine, prompts: list[Any], params: Any, rep: int
) -> tuple[float, float]:
    ids = [f"kv-{rep}-{i}" for i in range(len(prompts))]
    async with kv.paused():
        began = time.perf_counter()
        streams = [kv.generate(p, params, rid) for rid, p in zip(ids, prompts, strict=True)]
        accepted = time.perf_counter() - began
        await kv.run_on_engine(lambda e: None)  # answered after every Add before it
        admitted = time.perf_counter() - began
        await kv.abort(ids)
    for stream in streams:
        await stream
    return accepted, admitted


async def _parked_burst(
    kv: asynckv.AsyncEngine, prompts: list[Any], params: Any, rep: int
) -> tuple[float, float]:
    """Park a burst during a pause, then abort it: (seconds to park, seconds to abort)."""
    ids = [f"parked-{rep}-{i}" for i in range(len(prompts))]
    await kv.pause_generation(mode="abort", clear_cache=False)
    began = time.perf_counter()
    streams = [kv.generate(p, params, rid) for rid, p in zip(ids, prompts, strict=True)]
    await kv.run_on_engine(lambda e: None)
    parked = time.perf_counter() - began
    began = time.perf_counter()
    await kv.abort(ids)
    aborted = time.perf_counter() - began
    await kv.resume_generation()
    for stream in streams:
        await stream
    return parked, aborted


def _params(detokenize: bool, max_tokens: int = 16) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=detokenize
    )


async def submission(
    kv: asynckv.AsyncEngine, prompts: list[Any], reps: int, detokenize: bool, parked: bool
) -> dict[str, Any]:
    params = _params(detokenize)
    runs: dict[str, list[float]] = {
        "raw_add_s": [],
        "asynckv_accepted_s": [],
        "asynckv_admitted_s": [],
    }
    if parked:
        runs |= {"asynckv_parked_s": [], "asynckv_abort_parked_s": []}
    for rep in range(reps):
        runs["raw_add_s"].append(await _raw_burst(kv, prompts, params))
        a, b = await _kv_burst(kv, prompts, params, rep)
        runs["asynckv_accepted_s"].append(a)
        runs["asynckv_admitted_s"].append(b)
        if parked:
            c, d = await _parked_burst(kv, prompts, params, rep)
            runs["asynckv_parked_s"].append(c)
            runs["asynckv_abort_parked_s"].append(d)
        print(
            f"  submission rep {rep + 1}/{reps}: "
            + json.dumps({k: v[-1] for k, v in runs.items()}),
            flush=True,
        )
    median = {k: statistics.median(v) for k, v in runs.items()}
    return {"requests": len(prompts), **runs, "median": median}


# -- memory ----------------------------------------------------------------------------


def _charge(frames: Any) -> str:
    """Who allocated: the innermost frame in asynckv or vLLM (see the module docstring)."""
    for frame in reversed(frames):  # tracemalloc lists the oldest frame first
        name = frame.filename
        if name == HERE:
            return "harness"
        if name.startswith(ASYNCKV_DIR):
            return "asynckv"
        if f"{os.sep}vllm{os.sep}" in name:
            core = any(part in name for part in CORE_PARTS)
            return "vllm_core" if core else "vllm_client"
    return "other"


def _by_owner(now: tracemalloc.Snapshot, base: tracemalloc.Snapshot) -> dict[str, int]:
    owners = {"asynckv": 0, "vllm_client": 0, "vllm_core": 0, "other": 0, "harness": 0}
    for diff in now.compare_to(base, "traceback"):
        owners[_charge(diff.traceback)] += diff.size_diff
    return owners


async def memory(
    kv: asynckv.AsyncEngine, prompts: list[Any], n: int, detokenize: bool
) -> dict[str, Any]:
    params = _params(detokenize)
    ids = [f"mem-{n}-{i}" for i in range(n)]
    await kv.pause_generation(mode="abort", clear_cache=False)
    gc.collect()
    tracemalloc.start(32)
    base = tracemalloc.take_snapshot()
    streams = [kv.generate(p, params, rid) for rid, p in zip(ids, prompts[:n], strict=True)]
    await kv.run_on_engine(lambda e: None)
    gc.collect()
    parked = tracemalloc.take_snapshot()
    async with kv.paused():
        await kv.resume_generation()  # admits the parked, in order; the hold stops steps
        await kv.run_on_engine(lambda e: None)
        gc.collect()
        admitted = tracemalloc.take_snapshot()
        await kv.abort(ids)
    for stream in streams:
        await stream
    del streams
    await kv.run_on_engine(lambda e: None)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    out: dict[str, Any] = {}
    for phase, snap in (("parked", parked), ("admitted", admitted), ("after", after)):
        owners = _by_owner(snap, base)
        out[phase] = {k: v / n for k, v in owners.items()}  # bytes per request
    # What is still there once every request has ended: where it was allocated.
    out["after_top"] = [
        f"{d.traceback[-1].filename}:{d.traceback[-1].lineno} {d.size_diff:+,} B"
        for d in after.compare_to(base, "lineno")[:8]
    ]
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    kv = _build(args)
    detokenize = not args.load_format
    try:
        vocab = (await kv.run_on_engine(lambda e: e.model_config)).get_vocab_size()
        prompts = _prompts(max(args.requests, *args.memory_sizes), vocab)
        await _kv_burst(kv, prompts[:64], _params(detokenize, 4), -1)  # warm-up
        result: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
        result["load_before"] = os.getloadavg()
        if args.reps:
            result["submission"] = await submission(
                kv, prompts[: args.requests], args.reps, detokenize, args.parked
            )
        result["memory"] = {}
        for n in args.memory_sizes:
            result["memory"][str(n)] = await memory(kv, prompts, n, detokenize)
            print(f"  memory at {n}: {json.dumps(result['memory'][str(n)])}", flush=True)
        result["load_after"] = os.getloadavg()
        return result
    finally:
        await kv.aclose()


# -- the curve: plot and tables ----------------------------------------------------------

LABELS = {"raw": "raw LLMEngine loop", "asyncllm": "AsyncLLM", "asynckv": "asynckv"}


def _label(driver: str) -> str:
    if driver.startswith("asynckv_i"):
        return f"asynckv, stream_interval={float(driver[len('asynckv_i') :]) / 1e3:g}"
    return LABELS.get(driver, driver)


def facade_share(row: dict[str, Any], driver: str) -> float:
    """What ``driver`` spends per token beyond the raw loop, over what it spends."""
    raw: float = row["raw"]["cpu_s_per_1k_tok"]
    return 1.0 - raw / float(row[driver]["cpu_s_per_1k_tok"])


def curve_table(bench: dict[str, Any]) -> str:
    drivers = bench["drivers"]
    asyncs = [d for d in drivers if d != "raw"]
    names = " / ".join(_short(d) for d in drivers)
    anames = " / ".join(_short(d) for d in asyncs)
    lines = [
        f"| streams | tok/s {names} | TTFT p50 ms {names} | loop lag p99 ms {anames} "
        f"| CPU s per 1k tok {names} | facade share of main-process CPU {anames} "
        "| asynckv core share: loop / worker / vLLM output thread |",
        "| ---: | --- | --- | --- | --- | --- | --- |",
    ]
    for n, row in bench["main"].items():
        kv = row["asynckv"]
        lines.append(
            f"| {int(n):,} | {_join(row, drivers, 'tok_per_s', '{:,.0f}')} "
            f"| {_join(row, drivers, 'ttft_p50_ms', '{:,.1f}')} "
            f"| {_join(row, asyncs, 'lag_p99_ms', '{:.2f}')} "
            f"| {_join(row, drivers, 'cpu_s_per_1k_tok', '{:.3f}')} "
            f"| {' / '.join(f'{facade_share(row, d):.2f}' for d in asyncs)} "
            f"| {kv['cpu_share_main']:.2f} / {kv['cpu_share_worker']:.2f} / "
            f"{kv['cpu_share_vllm_io']:.2f} |"
        )
    return "\n".join(lines)


def _short(driver: str) -> str:
    return {"raw": "raw", "asyncllm": "AsyncLLM", "asynckv": "asynckv"}.get(
        driver, driver.replace("asynckv_", "")
    )


def _join(row: dict[str, Any], drivers: list[str], key: str, fmt: str) -> str:
    return " / ".join(fmt.format(row[d][key]) for d in drivers)


def cost_tables(cost: dict[str, Any]) -> str:
    lines = _submission_table(cost["submission"]) if "submission" in cost else []
    lines += [
        "",
        "| requests | state | asynckv | vLLM client side | vLLM engine core | other | total |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, phases in cost["memory"].items():
        for phase in ("parked", "admitted", "after"):
            owners = phases[phase]
            total = sum(v for k, v in owners.items() if k != "harness")
            cells = " | ".join(
                f"{owners[k]:,.0f}" for k in ("asynckv", "vllm_client", "vllm_core", "other")
            )
            lines.append(f"| {int(n):,} | {phase} | {cells} | {total:,.0f} |")
    return "\n".join(lines)


def _submission_table(sub: dict[str, Any]) -> list[str]:
    med = sub["median"]
    lines = [
        f"| {sub['requests']:,} requests, median of {len(sub['raw_add_s'])} | seconds "
        "| per request (us) | / raw |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, what in (
        ("raw_add_s", "raw: `add_request` x N on the worker thread"),
        ("asynckv_accepted_s", "asynckv: N `generate()` calls return (accepted)"),
        ("asynckv_admitted_s", "asynckv: all N through `add_request` (admitted)"),
        ("asynckv_parked_s", "asynckv, paused: N `generate()` calls parked"),
        ("asynckv_abort_parked_s", "asynckv, paused: the N parked requests aborted"),
    ):
        if key not in med:
            continue
        s = med[key]
        us = s / sub["requests"] * 1e6
        lines.append(f"| {what} | {s:.3f} | {us:.1f} | {s / med['raw_add_s']:.2f} |")
    return lines


def plot(bench: dict[str, Any], path: Path, cost: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [int(n) for n in bench["main"]]
    rows = [bench["main"][str(n)] for n in ns]
    drivers = bench["drivers"]
    colors = {"raw": "C0", "asyncllm": "C1", "asynckv": "C2"}
    columns = 3 if cost is None else 4
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 8))
    axes = axes.T  # fill column by column: axes.flat[k] keeps its place with 3 or 4 columns
    panels: list[tuple[str, str, str, bool]] = [
        ("tok_per_s", "throughput", "output tokens/s", False),
        ("ttft_p50_ms", "TTFT p50", "ms", True),
        ("lag_p99_ms", "event-loop lag p99", "ms", False),
        ("cpu_s_per_1k_tok", "main-process CPU per 1,000 tokens", "CPU s", True),
    ]
    for ax, (key, title, unit, logy) in zip(axes.flat, panels, strict=False):
        for d in drivers:
            if key == "lag_p99_ms" and d == "raw":
                continue
            ax.plot(ns, [r[d][key] for r in rows], "o-", label=_label(d), color=colors.get(d, "C3"))
        _axes(ax, title, unit, logy, ns)
    share = axes.flat[4]
    for d in drivers:
        if d != "raw":
            ys = [facade_share(r, d) for r in rows]
            share.plot(ns, ys, "o-", label=_label(d), color=colors.get(d, "C3"))
    _axes(share, "facade share of main-process CPU (1 - raw / driver)", "share", False, ns)
    threads = axes.flat[5]
    for role, style in (("main", "o-"), ("worker", "s-"), ("vllm_io", "^-")):
        ys = [r["asynckv"][f"cpu_share_{role}"] for r in rows]
        threads.plot(ns, ys, style, label=f"asynckv {role} thread", color="C2")
    ys = [r["asyncllm"]["cpu_share_main"] for r in rows]
    threads.plot(ns, ys, "o--", label="AsyncLLM main thread", color="C1")
    _axes(threads, "share of a core, per thread", "core share", False, ns)
    if cost is not None:
        _plot_cost(axes.flat[6], axes.flat[7], cost)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_cost(memory_ax: Any, submit_ax: Any, cost: dict[str, Any]) -> None:
    n = max(cost["memory"], key=int)
    phases = {k: v for k, v in cost["memory"][n].items() if k != "after_top"}
    owners = (
        ("asynckv", "asynckv", "C2"),
        ("vllm_client", "vLLM client side", "C0"),
        ("vllm_core", "vLLM engine core", "C7"),
        ("other", "other", "C5"),
    )
    bottom = [0.0] * len(phases)
    for owner, label, color in owners:
        heights = [p[owner] for p in phases.values()]
        memory_ax.bar(list(phases), heights, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    memory_ax.set_title(f"Python memory per request, {int(n):,} requests", fontsize=10)
    memory_ax.set_ylabel("bytes per request")
    memory_ax.legend(fontsize=7)
    memory_ax.grid(True, axis="y", alpha=0.3)
    sub = cost["submission"]
    med = sub["median"]
    bars = {
        "raw add_request": med["raw_add_s"],
        "asynckv accepted": med["asynckv_accepted_s"],
        "asynckv admitted": med["asynckv_admitted_s"],
    }
    submit_ax.bar(list(bars), list(bars.values()), color=["C0", "C2", "C2"])
    submit_ax.set_title(f"submitting {sub['requests']:,} requests (median)", fontsize=10)
    submit_ax.set_ylabel("s")
    submit_ax.grid(True, axis="y", alpha=0.3)


def _axes(ax: Any, title: str, unit: str, logy: bool, ns: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [f"{n:,}" for n in ns])
    ax.minorticks_off()
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def merge(files: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Every bench.py JSON's sizes in one (the drivers all of them ran), and the cost JSON."""
    benches = [f for f in files if "main" in f]
    costs = [f for f in files if "memory" in f]
    if not benches or len(costs) > 1 or len(benches) + len(costs) != len(files):
        raise SystemExit("give one or more bench.py JSONs and at most one JSON of `measure`")
    drivers = [d for d in benches[0]["drivers"] if all(d in b["drivers"] for b in benches)]
    sizes: dict[str, Any] = {}
    for b in benches:
        sizes |= b["main"]
    main = {n: {d: sizes[n][d] for d in drivers} for n in sorted(sizes, key=int)}
    return {"drivers": drivers, "main": main}, (costs[0] if costs else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="submission time and memory per request")
    m.add_argument("--requests", type=int, default=10_000)
    m.add_argument("--reps", type=int, default=5)
    m.add_argument("--memory-sizes", type=int, nargs="+", default=[1_000, 10_000])
    m.add_argument(
        "--parked",
        action="store_true",
        help="also time parking the burst during a pause, and aborting it parked",
    )
    m.add_argument("--model", default=None, help="checkpoint (default: the tiny model)")
    m.add_argument("--load-format", default=None, help="e.g. dummy: random weights, no tokenizer")
    m.add_argument("--gpu-memory-utilization", type=float, default=None)
    m.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile (CPU) or CUDA graphs: a build of seconds, for a smoke run",
    )
    m.add_argument("--out", type=Path, default=Path("results/cost"))
    p = sub.add_parser("plot", help="the curve from a bench.py JSON, and the tables")
    p.add_argument(
        "files",
        type=Path,
        nargs="+",
        help="benchmarks/bench.py JSONs (their sizes merged; a later file's size wins) "
        "and at most one JSON of `measure`",
    )
    p.add_argument("--out", type=Path, default=Path("results/cost-curve.png"))
    args = parser.parse_args()
    if args.command == "measure":
        result = asyncio.run(measure(args))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        path = args.out.with_suffix(".json")
        path.write_text(json.dumps(result, indent=2))
        print(cost_tables(result))
        print(f"wrote {path}")
        return
    bench, cost = merge([json.loads(path.read_text()) for path in args.files])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(bench, args.out, cost)
    print(curve_table(bench))
    if cost is not None:
        print()
        print(cost_tables(cost))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
