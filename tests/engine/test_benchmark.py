"""The benchmark runs end to end at its smallest size: it proves it works, not how fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_smallest_size(tmp_path: Path) -> None:
    """One repetition at one stream writes the JSON, the plot and the ratio table."""
    out = tmp_path / "bench"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench.py"),
            "--concurrency",
            "1",
            "--reps",
            "1",
            "--output-len",
            "4",
            "--run-seconds",  # a few bursts a run: the calibrated path, kept short
            "0.05",
            # Proves it works, not how fast: engines built eager (seconds, not a
            # torch.compile of about 40 s each), no wait for idle engine processes.
            "--enforce-eager",
            "--settle",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert set(results["main"]["1"]) == {"raw", "asyncllm", "asynckv"}
    rows = results["main"]["1"].values()
    bursts = {row["bursts"] for row in rows}
    assert len(bursts) == 1  # every driver did the same work
    assert all(row["output_tokens"] == 4 * row["bursts"] >= 4 for row in rows)
    assert results["consumers"]["slow_delta_20ms"]["asynckv"]["no_output_lost"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "kv/raw tok/s" in done.stdout


def test_cost_curve_smallest_size(tmp_path: Path) -> None:
    """`cost_curve.py measure` at its smallest size charges memory per request; `plot` draws it."""
    script = str(ROOT / "benchmarks" / "cost_curve.py")
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    out = tmp_path / "cost"
    # Compiled, as vLLM builds by default: eager, the client's memory grew by a few
    # kB while requests were parked (2.3 kB in one CI run), and this checks it stays 0.
    measure = ["measure", "--requests", "20", "--reps", "1", "--memory-sizes", "10"]
    done = subprocess.run(
        [sys.executable, script, *measure, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cost = json.loads(out.with_suffix(".json").read_text())
    assert cost["submission"]["requests"] == 20
    memory = cost["memory"]["10"]
    # Parked requests never reach vLLM's engine core; since their input is processed
    # when submitted (off the worker, issue 29), each holds its engine-core request
    # on the client side. Admitted ones cost vLLM's client more (its request state).
    assert memory["parked"]["asynckv"] > 0
    assert memory["parked"]["vllm_core"] == 0
    assert memory["admitted"]["vllm_client"] > 0
    png = tmp_path / "curve.png"
    bench = ROOT / "docs" / "img" / "cpu-issue16-separate.json"
    drawn = subprocess.run(
        [
            sys.executable,
            script,
            "plot",
            str(bench),
            str(out.with_suffix(".json")),
            "--out",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert drawn.returncode == 0, drawn.stderr[-4000:]
    assert png.stat().st_size > 0
    assert "facade share" in drawn.stdout
