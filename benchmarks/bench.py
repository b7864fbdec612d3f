"""Benchmark asynckv against the raw LLMEngine loop and vLLM's AsyncLLM.

One invocation builds one engine per driver from the same EngineArgs, then
sends the same workload through each, repetitions interleaved in every order
of the drivers in turn (``run_order``), each run after a garbage collection
and after waiting until every engine process is idle (``settle``). A run at N
streams is a series of bursts of N requests, as many as make it last about
``--run-seconds`` (``calibrate``, the same count for every driver). It reports
medians: output tokens/s, TTFT (from each request's own submission,
and ``ttft_burst`` from the burst's start, one instant for every driver),
inter-token latency, event-loop lag, main-process CPU per 1,000 output tokens
and RSS growth during the run. Loop lag, GIL wait and RSS growth come from
probed passes of their own, the rest from unprobed ones (``passes``).
It writes a JSON file and a PNG plot and prints the ratios asynckv / raw and
asynckv / AsyncLLM.

    python benchmarks/bench.py                      # the full run
    python benchmarks/bench.py --concurrency 1 --reps 1 --output-len 8   # a smoke run

On a GPU (scripts/gpu/README.md), with the 8B-shaped dummy checkpoint:

    python benchmarks/bench.py --model scripts/gpu/llama8b --load-format dummy \
        --skip-tokenizer-init --gpu-memory-utilization 0.25 --concurrency 1 64 256 1024

Every driver does identical engine work: token-id prompts (fixed seed, 32-128
tokens), greedy, ``ignore_eos``, a fixed output length. Figures on a shared
machine are noisy: compare the ratios of one run, never absolute figures
across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import itertools

import psutil
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from asynckv import AsyncEngine
from asynckv.testing import tiny_model

DRIVERS = ("raw", "asyncllm", "asynckv")
# asynckv again, on the same engine, with a lower sys.setswitchinterval (--switch-interval).
SWITCH_DRIVER = "asynckv_si"
COLORS = {"raw": "C0", "asyncllm": "C1", "asynckv": "C2", SWITCH_DRIVER: "C3"}


@dataclass
class Run:
    """What one repetition of one driver at one concurrency measured."""

    driver: str
    concurrency: int
    seconds: float
    output_tokens: int
    ttft: list[float] = field(default_factory=list)
    # From the burst's start, the same instant for every request of every driver.
    ttft_burst: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    gil: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0
    thread_cpu: dict[str, float] = field(default_factory=dict)
    rss_growth: int = 0


@dataclass
class Workload:
    """The prompts and sampling of every run.

    A run at ``n`` streams sends one or more bursts of ``n`` requests, one
    burst after another, each on the next ``n`` prompts (``burst``).
    """

    prompts: list[list[int]]
    params: SamplingParams

    def burst(self, n: int, index: int) -> list[list[int]]:
        """The prompts of burst ``index`` at ``n`` streams (wrapping round the prompts)."""
        start = (index * n) % len(self.prompts)
        return [self.prompts[(start + i) % len(self.prompts)] for i in range(n)]


def make_workload(
    n: int, output_len: int, vocab: int, seed: int, detokenize: bool = True
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(32, 128))] for _ in range(n)]
    params = SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=output_len, detokenize=detokenize
    )
    return Workload(prompts, params)


class Probe:
    """Watches this process during one run, on a thread of its own.

    - RSS: sampled every 20 ms; all drivers share one process, so the peak
      above the RSS at the start of a run is what that run added.
    - GIL wait: the thread sleeps 2 ms in a loop and records how late each
      wake-up is. Waking needs the GIL, so with free cores the lateness is
      the time spent waiting for it: what any thread of the process (the
      asynckv worker, vLLM's output thread) waits while another holds it.
    - CPU by thread: each Python thread's CPU clock during the run, grouped
      by role (see ``_role``); threads started outside Python (zmq's, torch's)
      count as "other". The probe's own CPU is left out of every figure.
    """

    def __init__(self, sample: bool = True) -> None:
        # sample=False: no thread at all, only the CPU clocks at both ends, so
        # the run it watches is not slowed by the watching (see ``passes``).
        self.sample = sample
        self.start = 0
        self.peak = 0
        self.gil_waits: list[float] = []
        self.thread_cpu: dict[str, float] = {}
        self._cpu0: dict[str, float] = {}
        self._probe_cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-probe", daemon=True)
        self._process = psutil.Process()

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            before = time.perf_counter()
            time.sleep(0.002)
            self.gil_waits.append(max(0.0, time.perf_counter() - before - 0.002))
            tick += 1
            if tick % 10 == 0:
                self.peak = max(self.peak, self._process.memory_info().rss)
        self._probe_cpu = time.thread_time()  # this thread's CPU, taken out of the figures

    @staticmethod
    def _cpu() -> dict[str, float]:
        """CPU seconds so far: the whole process, and each Python thread by role."""
        spent = {"process": time.process_time()}
        for thread in threading.enumerate():
            if thread.ident is None:
                continue
            try:
                clock = time.pthread_getcpuclockid(thread.ident)
                seconds = time.clock_gettime(clock)
            except OSError:  # the thread ended meanwhile
                continue
            role = _role(thread)
            spent[role] = spent.get(role, 0.0) + seconds
        return spent

    def __enter__(self) -> Probe:
        self.start = self.peak = self._process.memory_info().rss
        self._cpu0 = self._cpu()
        if self.sample:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self.sample:
            self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        # The probe's own thread had no clock at the start: count it all.
        self._cpu0.setdefault("probe", 0.0)
        cpu1 = self._cpu()
        cpu1.setdefault("probe", self._probe_cpu)
        spent = {role: cpu1.get(role, 0.0) - self._cpu0.get(role, 0.0) for role in cpu1}
        # Threads started outside Python (zmq's, torch's) are in "other" with the rest.
        named = sum(v for k, v in spent.items() if k not in ("process", "other", "probe"))
        self.thread_cpu = {k: v for k, v in spent.items() if k not in ("process", "other")}
        self.thread_cpu["other"] = spent["process"] - named - spent["probe"]

    def fill(self, run: Run) -> None:
        """Copy what was watched into ``run``."""
        run.rss_growth = self.peak - self.start
        run.gil = self.gil_waits
        run.thread_cpu = {k: v for k, v in self.thread_cpu.items() if k != "probe"}
        run.cpu_seconds = sum(run.thread_cpu.values())


def _role(thread: threading.Thread) -> str:
    """Which part of the process a thread is: the ones whose CPU the report shows."""
    if thread is threading.main_thread():
        return "main"  # the event loop, or the raw driver's stepping loop
    if thread.name == "asynckv-engine":
        return "worker"  # asynckv's worker thread: step() and output processing
    if thread.name == "bench-probe":
        return "probe"  # left out of the CPU figures
    if thread.name == "EngineCoreOutputQueueThread":
        return "vllm_io"  # a sync engine's thread that decodes the core's outputs
    return "other"


async def measure_lag(stop: asyncio.Event, lags: list[float]) -> None:
    """Sleep 1 ms in a loop and record how late each wake-up is."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.001)
        lags.append(max(0.0, loop.time() - before - 0.001))


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


# -- the drivers ---------------------------------------------------------------------


def run_raw(
    engine: LLMEngine, work: Workload, concurrency: int, probed: bool = True, bursts: int = 1
) -> Run:
    """The sync loop: add every request of a burst, step until done. The floor for any wrapper."""
    arrivals: dict[str, float] = {}
    starts: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    tokens = 0
    t0 = time.perf_counter()
    with Probe(probed) as probe:
        for index in range(bursts):
            began = time.perf_counter()
            for prompt in work.burst(concurrency, index):
                rid = uuid.uuid4().hex
                arrivals[rid], starts[rid], stamps[rid] = time.perf_counter(), began, []
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), work.params)
            while engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.perf_counter()
                for out in outputs:
                    stamps[out.request_id].append(now)
                    if out.finished:
                        tokens += len(out.outputs[0].token_ids)
    run = Run("raw", concurrency, time.perf_counter() - t0, tokens)
    probe.fill(run)
    for rid, times in stamps.items():
        run.ttft.append(times[0] - arrivals[rid])
        run.ttft_burst.append(times[0] - starts[rid])
        run.itl.extend(gaps(times))
    return run


async def _drive(
    name: str,
    concurrency: int,
    work: Workload,
    submit: Callable[[str, list[int], SamplingParams], Any],
    per_output: Callable[[], Awaitable[None]] | None = None,
    probed: bool = True,
    bursts: int = 1,
) -> Run:
    """Run one task per request consuming its stream; measure everything.

    Unprobed (``probed=False``), no lag task runs beside the streams: the raw
    loop has no event loop to probe, so a 1 kHz timer task there would load
    only the async drivers.
    """
    stop = asyncio.Event()
    run = Run(name, concurrency, 0.0, 0)
    lag_task = asyncio.create_task(measure_lag(stop, run.lag)) if probed else None
    await asyncio.sleep(0.005)  # let the lag probe settle

    async def one(prompt: list[int], began: float) -> int:
        arrival = time.perf_counter()
        stamps: list[float] = []
        tokens = 0
        async for out in submit(uuid.uuid4().hex, prompt, work.params):
            stamps.append(time.perf_counter())
            if work.params.output_kind is RequestOutputKind.DELTA:
                tokens += len(out.outputs[0].token_ids)
            else:
                tokens = len(out.outputs[0].token_ids)
            if per_output is not None:
                await per_output()
        run.ttft.append(stamps[0] - arrival)
        run.ttft_burst.append(stamps[0] - began)
        run.itl.extend(gaps(stamps))
        return tokens

    t0 = time.perf_counter()
    with Probe(probed) as probe:
        for index in range(bursts):
            began = time.perf_counter()
            prompts = work.burst(concurrency, index)
            counts = await asyncio.gather(*(one(p, began) for p in prompts))
            run.output_tokens += sum(counts)
    run.seconds = time.perf_counter() - t0
    probe.fill(run)
    stop.set()
    if lag_task is not None:
        await lag_task
    return run


async def run_asyncllm(
    llm: AsyncLLM,
    work: Workload,
    concurrency: int,
    per_output: Any = None,
    probed: bool = True,
    bursts: int = 1,
) -> Run:
    def submit(rid: str, prompt: list[int], params: SamplingParams) -> Any:
        return llm.generate(TokensPrompt(prompt_token_ids=prompt), params, rid)

    return await _drive("asyncllm", concurrency, work, submit, per_output, probed, bursts)


async def run_asynckv(
    engine: AsyncEngine,
    work: Workload,
    concurrency: int,
    per_output: Any = None,
    interval: float | None = None,
    probed: bool = True,
    bursts: int = 1,
) -> Run:
    def submit(rid: str, prompt: list[int], params: SamplingParams) -> Any:
        prompt_ = TokensPrompt(prompt_token_ids=prompt)
        return engine.generate(prompt_, params, rid, stream_interval=interval)

    return await _drive("asynckv", concurrency, work, submit, per_output, probed, bursts)


# -- summaries -------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summarise(run: Run) -> dict[str, float]:
    return {
        "tok_per_s": run.output_tokens / run.seconds,
        "ttft_p50_ms": pct(run.ttft, 50) * 1e3,
        "ttft_p99_ms": pct(run.ttft, 99) * 1e3,
        "ttft_burst_p50_ms": pct(run.ttft_burst, 50) * 1e3,
        "itl_p50_ms": pct(run.itl, 50) * 1e3,
        "itl_p99_ms": pct(run.itl, 99) * 1e3,
        "lag_p50_ms": pct(run.lag, 50) * 1e3,
        "lag_p99_ms": pct(run.lag, 99) * 1e3,
        "lag_max_ms": max(run.lag) * 1e3 if run.lag else float("nan"),
        "gil_wait_p50_ms": pct(run.gil, 50) * 1e3,
        "gil_wait_p99_ms": pct(run.gil, 99) * 1e3,
        "gil_wait_max_ms": max(run.gil) * 1e3 if run.gil else float("nan"),
        "cpu_s_per_1k_tok": run.cpu_seconds / run.output_tokens * 1e3,
        # Share of one core each role used over the run: main + worker + vllm_io
        # near 1.0 means the process is bound by the GIL, not by the engine.
        **{
            f"cpu_share_{role}": run.thread_cpu.get(role, 0.0) / run.seconds
            for role in ("main", "worker", "vllm_io", "other")
        },
        "rss_growth_mib": run.rss_growth / 2**20,
        "output_tokens": float(run.output_tokens),
    }


# What the probes watch: taken from the probed repetitions only (see ``passes``).
PROBED_KEYS = (
    "lag_p50_ms",
    "lag_p99_ms",
    "lag_max_ms",
    "gil_wait_p50_ms",
    "gil_wait_p99_ms",
    "gil_wait_max_ms",
    "rss_growth_mib",
)


def passes(args: argparse.Namespace, rep: int) -> tuple[bool, ...]:
    """Which passes repetition ``rep`` makes over the drivers: unprobed, probed, or both.

    The lag task (a 1 kHz timer on the event loop) and the GIL/RSS thread
    wake the process thousands of times a second, and only the async drivers
    carry the lag task. So throughput, TTFT, ITL and CPU come from unprobed
    passes, and the lag, the GIL wait and the RSS growth from probed passes of
    their own, interleaved with them (the first ``--probe-reps`` repetitions
    make both). ``--inline-probes``: every pass probed and every figure from
    it, as before this split.
    """
    if args.inline_probes:
        return (True,)
    return (False, True) if rep < args.probe_reps else (False,)


def run_order(drivers: list[str], rep: int) -> list[str]:
    """The drivers' order in repetition ``rep``: rotated, and reversed every other time.

    Rotating alone keeps the cycle (raw, AsyncLLM, asynckv, raw, ...), so each
    driver would always run right after the same other one, and inherit its
    leftovers: in one 20-repetition run at 16 streams asynckv made 1.14 x its
    median right after raw and 0.98 x after AsyncLLM, its predecessor 14 times
    in 20. Rotations of the order and of its reverse: each driver runs first,
    and after each other driver, equally often (all six orders of three).
    """
    shift = (rep // 2) % len(drivers)
    turned = drivers[shift:] + drivers[:shift]
    return turned[::-1] if rep % 2 else turned


def combine(plain: list[Run], probed: list[Run], waits: list[float]) -> dict[str, Any]:
    """One driver's row: medians of ``plain``, the probed figures from ``probed``."""
    row: dict[str, Any] = medians(plain)
    watched = medians(probed) if probed else {}
    row.update({key: watched.get(key, float("nan")) for key in PROBED_KEYS})
    row["repetitions"] = len(plain)
    row["probed_repetitions"] = len(probed)
    # Every repetition's throughput, so the spread behind the median is on record.
    row["tok_per_s_reps"] = [r.output_tokens / r.seconds for r in plain]
    row["settle_s_max"] = max(waits, default=0.0)
    return row


def ratio_intervals(runs: dict[str, list[Run]], resamples: int = 2000) -> dict[str, list[float]]:
    """95 % bootstrap intervals of asynckv's throughput over raw's, AsyncLLM's and the better's.

    The repetitions are resampled as whole rounds (one run of each driver,
    back to back), so what a round shares, the machine's state then, stays
    paired; each ratio is of medians, as in the table. Seeded: the same runs
    give the same intervals.
    """
    rates = {d: [r.output_tokens / r.seconds for r in runs[d]] for d in DRIVERS}
    rounds = min(len(v) for v in rates.values())
    rng = random.Random(0)
    samples: dict[str, list[float]] = {"raw": [], "asyncllm": [], "better": []}
    for _ in range(resamples if rounds > 1 else 0):
        picks = [rng.randrange(rounds) for _ in range(rounds)]
        med = {d: statistics.median(rates[d][i] for i in picks) for d in DRIVERS}
        samples["raw"].append(med["asynckv"] / med["raw"])
        samples["asyncllm"].append(med["asynckv"] / med["asyncllm"])
        samples["better"].append(med["asynckv"] / max(med["raw"], med["asyncllm"]))
    return {
        key: [pct(values, 2.5), pct(values, 97.5)] if values else [float("nan")] * 2
        for key, values in samples.items()
    }


async def settle(limit: float) -> float:
    """Wait until every engine process of this run is idle; return the seconds waited.

    After its last step each of vLLM's engine processes keeps polling its
    shared-memory queue for a second (``SpinCondition.busy_loop_s``), and
    the CPU backend binds every engine's worker to the same core. Without
    this wait a repetition shares that core with the engine of the repetition
    before it (measured on the 2-core machine: that engine's worker used 0.09
    to 0.17 of a core during the next driver's run). Idle: this process's
    descendants together use under 3 % of a core over 100 ms. At most
    ``limit`` seconds; 0 skips the wait.
    """
    began = time.perf_counter()
    me = os.getpid()
    while time.perf_counter() - began < limit:
        before = process_cpu()
        await asyncio.sleep(0.1)
        after = process_cpu()
        busy = sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items() if pid != me)
        if busy < 0.003:
            break
    return time.perf_counter() - began


def stray_engines() -> list[int]:
    """The pids of vLLM engine processes on this machine that this run did not start.

    An engine left behind by an interrupted run keeps polling its queue and
    takes CPU from every driver of the next one (three such engines used half
    a core on the 2-core machine). ``bench`` names them before it starts.
    """
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    found = []
    for process in psutil.process_iter(["name"]):
        name = process.info["name"] or ""
        if name.startswith("VLLM::") and process.pid not in mine:
            found.append(process.pid)
    return found


def process_cpu() -> dict[int, float]:
    """CPU seconds so far of this process and each of its descendants, by pid."""
    me = psutil.Process()
    spent = {}
    for process in (me, *me.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        spent[process.pid] = times.user + times.system
    return spent


def medians(runs: list[Run]) -> dict[str, float]:
    rows = [summarise(r) for r in runs]
    out = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    # A lost token shows in any repetition, not only the median one.
    out["output_tokens_min"] = min(row["output_tokens"] for row in rows)
    return out


# -- main ------------------------------------------------------------------------------


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or str(tiny_model())
    settings: dict[str, Any] = {
        "model": model,
        "max_model_len": args.max_model_len,
        "seed": 0,
        "disable_log_stats": True,
        "max_num_seqs": args.max_num_seqs,
    }
    # GPU runs: a config-only checkpoint with random weights, no tokenizer.
    if args.load_format:
        settings["load_format"] = args.load_format
    if args.skip_tokenizer_init:
        settings["skip_tokenizer_init"] = True
    if args.gpu_memory_utilization is not None:
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        settings["enforce_eager"] = True
    return settings


def interval_driver(args: argparse.Namespace) -> str | None:
    """The name of the asynckv driver with a stream interval (--stream-interval), if any."""
    return None if args.stream_interval is None else f"asynckv_i{args.stream_interval:g}"


class Engines:
    """The drivers' engines, all in this process (the shared mode)."""

    def __init__(self, settings: dict[str, Any], args: argparse.Namespace) -> None:
        self.settings, self.args = settings, args

    @classmethod
    def with_defaults(cls, concurrency: list[int], output_len: int) -> Engines:
        """The engines of a plain ``bench.py`` run at these sizes (for the diagnostics)."""
        args = build_parser().parse_args(
            ["--concurrency", *map(str, concurrency), "--output-len", str(output_len)]
        )
        return cls(engine_settings(args), args)

    async def start(self) -> int:
        self.raw = LLMEngine.from_engine_args(EngineArgs(**self.settings))
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.settings))
        self.kv = AsyncEngine.from_engine_args(EngineArgs(**self.settings))
        await self.kv.start()
        vocab: int = self.raw.model_config.get_vocab_size()
        self.work = workload_for(self.args, vocab)
        for driver in ("raw", "asyncllm", "asynckv"):  # warm: first steps compile, allocate
            await self.run(driver, 4)
        return vocab

    async def run(self, driver: str, n: int, probed: bool = True, bursts: int = 1) -> Run:
        return await run_driver(
            driver, n, self.work, self.args, self.raw, self.llm, self.kv, probed, bursts
        )

    async def close(self) -> None:
        await self.kv.aclose()
        self.llm.shutdown()
        self.raw.engine_core.shutdown()


def workload_for(args: argparse.Namespace, vocab: int) -> Workload:
    """The same workload in every process: it depends on the arguments and the vocabulary only."""
    return make_workload(
        max(*args.concurrency, 4),
        args.output_len,
        vocab,
        seed=0,
        detokenize=not args.skip_tokenizer_init,
    )


async def run_driver(
    driver: str,
    n: int,
    work: Workload,
    args: argparse.Namespace,
    raw: LLMEngine | None,
    llm: AsyncLLM | None,
    kv: AsyncEngine | None,
    probed: bool = True,
    bursts: int = 1,
) -> Run:
    """One repetition of ``driver`` at ``n`` streams, ``bursts`` bursts, on the engines given.

    It first collects this process's garbage: in the shared mode, a driver's
    run would otherwise pay the collections of the garbage the run before it
    left (AsyncLLM's, asynckv's or raw's), in the separate mode its own last run's.
    """
    gc.collect()
    if driver == "raw":
        assert raw is not None
        return run_raw(raw, work, n, probed, bursts)
    if driver == "asyncllm":
        assert llm is not None
        return await run_asyncllm(llm, work, n, probed=probed, bursts=bursts)
    assert kv is not None
    if driver == SWITCH_DRIVER:
        default = sys.getswitchinterval()
        sys.setswitchinterval(args.switch_interval / 1e3)
        try:
            run = await run_asynckv(kv, work, n, probed=probed, bursts=bursts)
        finally:
            sys.setswitchinterval(default)
    elif driver == interval_driver(args):
        interval = args.stream_interval / 1e3
        run = await run_asynckv(kv, work, n, interval=interval, probed=probed, bursts=bursts)
    else:
        run = await run_asynckv(kv, work, n, probed=probed, bursts=bursts)
    run.driver = driver
    return run


def _driver_process(
    kind: str, settings: dict[str, Any], args: argparse.Namespace, conn: Any
) -> None:
    """A process of one engine: builds it, warms it, then runs what the parent asks."""
    asyncio.run(_serve_driver(kind, settings, args, conn))


async def _serve_driver(
    kind: str, settings: dict[str, Any], args: argparse.Namespace, conn: Any
) -> None:
    raw = llm = kv = None
    if kind == "raw":
        raw = LLMEngine.from_engine_args(EngineArgs(**settings))
        vocab = raw.model_config.get_vocab_size()
    elif kind == "asyncllm":
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**settings))
        vocab = llm.model_config.get_vocab_size()
    else:
        kv = AsyncEngine.from_engine_args(EngineArgs(**settings))
        await kv.start()
        vocab = (await kv.run_on_engine(lambda e: e.model_config)).get_vocab_size()
    work = workload_for(args, vocab)
    await run_driver(kind, 4, work, args, raw, llm, kv)
    conn.send(("ready", vocab))
    try:
        while True:
            message = conn.recv()  # between runs: nothing else to do on this loop
            if message is None:
                break
            driver, n, probed, bursts = message
            conn.send(await run_driver(driver, n, work, args, raw, llm, kv, probed, bursts))
    finally:
        if kv is not None:
            await kv.aclose()
        if llm is not None:
            llm.shutdown()
        if raw is not None:
            raw.engine_core.shutdown()


class Processes:
    """Each driver's engine in a process of its own (the separate mode): no shared GIL or GC."""

    def __init__(self, settings: dict[str, Any], args: argparse.Namespace) -> None:
        import multiprocessing

        self._ctx = multiprocessing.get_context("spawn")
        self.settings, self.args = settings, args
        self._procs: dict[str, tuple[Any, Any]] = {}

    async def start(self) -> int:
        vocab = 0
        # One at a time: engine starts compete for memory and (on a GPU) compile caches.
        for kind in ("raw", "asyncllm", "asynckv"):
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=_driver_process, args=(kind, self.settings, self.args, child), daemon=False
            )
            proc.start()
            self._procs[kind] = (proc, parent)
            status, vocab = await asyncio.to_thread(parent.recv)
            assert status == "ready"
        return vocab

    async def run(self, driver: str, n: int, probed: bool = True, bursts: int = 1) -> Run:
        kind = "asynckv" if driver.startswith("asynckv") else driver
        _, conn = self._procs[kind]
        conn.send((driver, n, probed, bursts))
        run: Run = await asyncio.to_thread(conn.recv)
        return run

    async def close(self) -> None:
        for _proc, conn in self._procs.values():
            with contextlib.suppress(Exception):
                conn.send(None)
        for proc, _ in self._procs.values():
            await asyncio.to_thread(proc.join, 60)
            if proc.is_alive():
                proc.kill()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = engine_settings(args)
    model = settings["model"]
    print(f"building engines for {model} ({args.mode} mode) ...", file=sys.stderr)
    strays = stray_engines()
    if strays:
        print(f"WARNING: vLLM processes not of this run are alive: {strays}", file=sys.stderr)
    engines: Engines | Processes = (
        Processes(settings, args) if args.mode == "separate" else Engines(settings, args)
    )
    drivers = [*DRIVERS, *([SWITCH_DRIVER] if args.switch_interval is not None else [])]
    if interval_driver(args) is not None:
        drivers.append(interval_driver(args))  # type: ignore[arg-type]
    results: dict[str, Any] = {
        "settings": vars(args) | {"model": model, "stray_engines": strays},
        "drivers": drivers,
        "main": {},
    }
    try:
        await engines.start()
        for n in args.concurrency:
            plain: dict[str, list[Run]] = {d: [] for d in drivers}
            probed: dict[str, list[Run]] = {d: [] for d in drivers}
            waits: dict[str, list[float]] = {d: [] for d in drivers}
            bursts = await calibrate(engines, n, args)
            for rep in range(args.reps):
                for watched in passes(args, rep):
                    for driver in run_order(drivers, rep):
                        waits[driver].append(await settle(args.settle))
                        run = await engines.run(driver, n, watched, bursts)
                        if not watched or args.inline_probes:
                            plain[driver].append(run)
                        if watched:
                            probed[driver].append(run)
                print(f"  c={n} rep={rep + 1}/{args.reps} done", file=sys.stderr)
            results["main"][str(n)] = {d: combine(plain[d], probed[d], waits[d]) for d in drivers}
            results["main"][str(n)]["raw"].update(
                {"lag_p50_ms": None, "lag_p99_ms": None, "lag_max_ms": None}
            )
            results["main"][str(n)]["asynckv"]["ratio_ci95"] = ratio_intervals(plain)
            for driver in drivers:
                results["main"][str(n)][driver]["bursts"] = bursts
            # Keep what is measured so far: a run cut short still leaves its sizes.
            save_json(results, args.out)
            print(ratio_table(results), file=sys.stderr)
        if args.no_consumers or not isinstance(engines, Engines):
            results["consumers"] = {}
        else:
            results["consumers"] = await consumer_workloads(
                engines.llm, engines.kv, engines.work, args
            )
    finally:
        await engines.close()
    return results


async def calibrate(engines: Engines | Processes, n: int, args: argparse.Namespace) -> int:
    """How many bursts make a run of ``n`` streams last about ``--run-seconds``.

    Timed on raw, single bursts until they add up to that long, then fixed for
    every driver and repetition at this size, so each does identical work. A
    single burst at one stream lasts about 0.1 s on the 2-core machine, and
    its throughput varied by a factor of 1.9 between repetitions.
    """
    if args.run_seconds <= 0:
        return 1
    spent, timed = 0.0, 0
    while spent < args.run_seconds:
        await settle(args.settle)
        spent += (await engines.run("raw", n, probed=False)).seconds
        timed += 1
    return max(1, math.ceil(float(args.run_seconds) / (spent / timed)))


async def consumer_workloads(
    llm: AsyncLLM, kv: AsyncEngine, work: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    """Streaming consumers that work ~50 us per output, and slow DELTA consumers."""
    n = min(64, max(args.concurrency))
    out: dict[str, Any] = {}

    async def busy() -> None:
        end = time.perf_counter() + 50e-6
        while time.perf_counter() < end:
            pass

    out["busy_50us"] = {
        "asyncllm": summarise(await run_asyncllm(llm, work, n, busy)),
        "asynckv": summarise(await run_asynckv(kv, work, n, busy)),
    }

    async def slow() -> None:
        await asyncio.sleep(0.02)

    delta = Workload(
        work.prompts,
        SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=work.params.max_tokens,
            output_kind=RequestOutputKind.DELTA,
            detokenize=work.params.detokenize,
        ),
    )
    expected = n * (work.params.max_tokens or 0)
    slow_results = {}
    drivers: list[tuple[str, Callable[[], Awaitable[Run]]]] = [
        ("asyncllm", lambda: run_asyncllm(llm, delta, n, slow)),
        ("asynckv", lambda: run_asynckv(kv, delta, n, slow)),
    ]
    for name, again in drivers:
        first, second = await again(), await again()
        slow_results[name] = {
            "tokens_expected": expected,
            "tokens_received": [first.output_tokens, second.output_tokens],
            "no_output_lost": first.output_tokens == second.output_tokens == expected,
            "rss_growth_mib": [first.rss_growth / 2**20, second.rss_growth / 2**20],
            "outputs_received": [len(first.itl) + n, len(second.itl) + n],
        }
    out["slow_delta_20ms"] = slow_results
    return out


def ratio_table(results: dict[str, Any]) -> str:
    lines = [
        f"{'streams':>7} | {'kv/raw tok/s':>12} {'kv/async tok/s':>14} {'kv/better':>9} "
        f"{'95% interval':>13} | "
        f"{'TTFT50 raw/async/kv ms':>24} | {'lag p99 async/kv ms':>20} | "
        f"{'CPU/1k raw/async/kv s':>22}"
    ]
    for n, row in results["main"].items():
        raw, al, kv = row["raw"], row["asyncllm"], row["asynckv"]
        lines.append(
            f"{n:>7} | {kv['tok_per_s'] / raw['tok_per_s']:>12.3f} "
            f"{kv['tok_per_s'] / al['tok_per_s']:>14.3f} "
            f"{kv['tok_per_s'] / max(raw['tok_per_s'], al['tok_per_s']):>9.3f} "
            f"{_interval(kv.get('ratio_ci95', {}).get('better')):>13} | "
            f"{raw['ttft_p50_ms']:>7.1f}/{al['ttft_p50_ms']:>6.1f}/{kv['ttft_p50_ms']:>6.1f}"
            f"{'':>3} | {al['lag_p99_ms']:>9.2f}/{kv['lag_p99_ms']:>6.2f}{'':>4} | "
            f"{raw['cpu_s_per_1k_tok']:>6.3f}/{al['cpu_s_per_1k_tok']:>6.3f}/"
            f"{kv['cpu_s_per_1k_tok']:>6.3f}"
        )
    lines.append("")
    lines.append(gil_table(results))
    return "\n".join(lines)


def _interval(bounds: list[float] | None) -> str:
    return "-" if not bounds else f"{bounds[0]:.3f}-{bounds[1]:.3f}"


def gil_table(results: dict[str, Any]) -> str:
    """Per driver: tok/s over raw, GIL wait, and the share of a core each thread used."""
    lines = [
        f"{'streams':>7} {'driver':>11} | {'/raw':>6} | {'GIL wait p50/p99/max ms':>24} | "
        f"{'lag p99/max ms':>15} | {'core share main/worker/vllm_io':>31}"
    ]
    for n, row in results["main"].items():
        for d, m in row.items():
            lag = (
                f"{m['lag_p99_ms']:>6.2f}/{m['lag_max_ms']:>7.1f}"
                if m.get("lag_p99_ms") is not None
                else f"{'-':>15}"
            )
            lines.append(
                f"{n:>7} {d:>11} | {m['tok_per_s'] / row['raw']['tok_per_s']:>6.3f} | "
                f"{m['gil_wait_p50_ms']:>8.2f}/{m['gil_wait_p99_ms']:>6.2f}/"
                f"{m['gil_wait_max_ms']:>7.1f} | {lag} | "
                f"{m['cpu_share_main']:>13.2f}/{m['cpu_share_worker']:>6.2f}/"
                f"{m['cpu_share_vllm_io']:>6.2f}"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [int(n) for n in results["main"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for d in results["drivers"]:
        left.plot(
            ns,
            [results["main"][str(n)][d]["tok_per_s"] for n in ns],
            "o-",
            label=d,
            color=COLORS.get(d, "C4"),
        )
        if d != "raw":
            right.plot(
                ns,
                [results["main"][str(n)][d]["lag_p99_ms"] for n in ns],
                "o-",
                label=d,
                color=COLORS.get(d, "C4"),
            )
    for ax, title, unit in (
        (left, "throughput", "output tokens/s"),
        (right, "event-loop lag p99", "ms"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save_json(results: dict[str, Any], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".json")
    path.write_text(json.dumps(results, indent=2, default=str))
    return path


def build_parser() -> argparse.ArgumentParser:
    """bench.py's command line (also the defaults of ``Engines.with_defaults``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the tiny model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--run-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help="each run at N streams sends bursts of N requests one after another, as many as "
        "make raw's run last about S seconds (timed once per size, then the same for every "
        "driver and repetition); 0: one burst",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    gpu = parser.add_argument_group("GPU runs (scripts/gpu/README.md)")
    gpu.add_argument("--load-format", default=None, help="e.g. dummy: random weights")
    gpu.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="no tokenizer (token-id prompts; outputs not detokenized)",
    )
    gpu.add_argument("--gpu-memory-utilization", type=float, default=None)
    gpu.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs or compile")
    parser.add_argument(
        "--no-consumers", action="store_true", help="skip the busy/slow consumer workloads"
    )
    parser.add_argument(
        "--probe-reps",
        type=int,
        default=3,
        help="repetitions (the first K) that also make a probed pass, which alone gives the "
        "loop lag, GIL wait and RSS growth; the unprobed passes give everything else",
    )
    parser.add_argument(
        "--inline-probes",
        action="store_true",
        help="probe every pass and take every figure from it (the method before --probe-reps)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        metavar="S",
        help="before each pass, wait up to S seconds for every engine process to go idle "
        "(0: don't wait)",
    )
    parser.add_argument(
        "--mode",
        choices=("shared", "separate"),
        default="shared",
        help="shared: every driver's engine in this process; separate: each in a process "
        "of its own (own GIL, own garbage collector; no consumer workloads)",
    )
    parser.add_argument(
        "--stream-interval",
        type=float,
        default=None,
        metavar="MS",
        help="also run asynckv with generate(..., stream_interval=MS / 1000)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        metavar="MS",
        help=f"also run asynckv ({SWITCH_DRIVER}) with sys.setswitchinterval(MS / 1000)",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    results = asyncio.run(bench(args))
    json_path, png_path = save_json(results, args.out), args.out.with_suffix(".png")
    plot(results, png_path)
    print(ratio_table(results))
    if results["consumers"]:
        print(json.dumps(results["consumers"], indent=2))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
