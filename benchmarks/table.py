"""Print the markdown tables of a bench.py JSON file (as in docs/performance.md).

python benchmarks/table.py results/bench.json
python benchmarks/table.py --targets results/bench.json   # issue 16's table, against its targets
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main_table(results: dict[str, Any]) -> str:
    """Throughput, ratios, TTFT and loop lag per size: raw, AsyncLLM, asynckv."""
    lines = [
        "| streams | raw tok/s | AsyncLLM tok/s | asynckv tok/s | asynckv / raw "
        "| asynckv / AsyncLLM | TTFT p50 raw / AsyncLLM / asynckv (ms) "
        "| loop lag p99 AsyncLLM / asynckv (ms) | loop lag max AsyncLLM / asynckv (ms) "
        "| CPU s per 1k tokens raw / AsyncLLM / asynckv |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |",
    ]
    for n, row in results["main"].items():
        raw, al, kv = row["raw"], row["asyncllm"], row["asynckv"]
        lines.append(
            f"| {int(n):,} | {raw['tok_per_s']:,.0f} | {al['tok_per_s']:,.0f} "
            f"| {kv['tok_per_s']:,.0f} | {kv['tok_per_s'] / raw['tok_per_s']:.3f} "
            f"| {kv['tok_per_s'] / al['tok_per_s']:.3f} "
            f"| {raw['ttft_p50_ms']:,.1f} / {al['ttft_p50_ms']:,.1f} / {kv['ttft_p50_ms']:,.1f} "
            f"| {al['lag_p99_ms']:.2f} / {kv['lag_p99_ms']:.2f} "
            f"| {al['lag_max_ms']:,.1f} / {kv['lag_max_ms']:,.1f} "
            f"| {raw['cpu_s_per_1k_tok']:.3f} / {al['cpu_s_per_1k_tok']:.3f} "
            f"/ {kv['cpu_s_per_1k_tok']:.3f} |"
        )
    return "\n".join(lines)


def gil_table(results: dict[str, Any]) -> str:
    """Per driver: GIL wait (the probe thread's lateness) and each thread's share of a core."""
    lines = [
        "| streams | driver | tok/s / raw | GIL wait p50 / p99 / max (ms) "
        "| core share: main / worker / vLLM output thread | CPU s per 1k tokens |",
        "| ---: | --- | ---: | --- | --- | ---: |",
    ]
    for n, row in results["main"].items():
        for driver, m in row.items():
            lines.append(
                f"| {int(n):,} | {driver} | {m['tok_per_s'] / row['raw']['tok_per_s']:.3f} "
                f"| {m['gil_wait_p50_ms']:.2f} / {m['gil_wait_p99_ms']:.2f} "
                f"/ {m['gil_wait_max_ms']:.1f} "
                f"| {m['cpu_share_main']:.2f} / {m['cpu_share_worker']:.2f} "
                f"/ {m['cpu_share_vllm_io']:.2f} | {m['cpu_s_per_1k_tok']:.3f} |"
            )
    return "\n".join(lines)


def targets_table(results: dict[str, Any]) -> str:
    """Issue 16's table: the figures its targets name, and the ``--stream-interval`` driver's."""
    interval = next((d for d in results["drivers"] if d.startswith("asynckv_i")), None)
    head = (
        "| streams | tok/s raw / AsyncLLM / asynckv | TTFT p50 ms raw / AsyncLLM / asynckv "
        "| TTFT p50 from the burst's start, ms | CPU s per 1k tok raw / AsyncLLM / asynckv "
        "| loop lag p99 ms AsyncLLM / asynckv |"
    )
    rule = "| ---: | --- | --- | --- | --- | --- |"
    if interval is not None:
        head += (
            f" `{interval}`: loop-thread core share asynckv -> it / lag p99 ms / tok/s vs "
            "asynckv / fewest tokens of a repetition |"
        )
        rule += " --- |"
    lines = [head, rule]
    drivers = ("raw", "asyncllm", "asynckv")
    for n, row in results["main"].items():

        def three(key: str, fmt: str, row: dict[str, Any] = row) -> str:
            return " / ".join(fmt.format(row[d][key]) for d in drivers)

        al, kv = row["asyncllm"], row["asynckv"]
        burst = three("ttft_burst_p50_ms", "{:,.1f}") if "ttft_burst_p50_ms" in kv else "-"
        line = (
            f"| {int(n):,} | {three('tok_per_s', '{:,.0f}')} | {three('ttft_p50_ms', '{:,.1f}')} "
            f"| {burst} | {three('cpu_s_per_1k_tok', '{:.3f}')} "
            f"| {al['lag_p99_ms']:.2f} / {kv['lag_p99_ms']:.2f} |"
        )
        if interval is not None:
            it = row[interval]
            fewest = (
                f"{it['output_tokens_min']:,.0f}"
                if "output_tokens_min" in it
                else f"{it['output_tokens']:,.0f} (median)"
            )
            line += (
                f" {kv['cpu_share_main']:.2f} -> {it['cpu_share_main']:.2f} "
                f"/ {it['lag_p99_ms']:.2f} / {it['tok_per_s'] / kv['tok_per_s']:.3f} "
                f"/ {fewest} |"
            )
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--targets":
        print(targets_table(json.loads(Path(sys.argv[2]).read_text())))
        sys.exit()
    data = json.loads(Path(sys.argv[1]).read_text())
    print(main_table(data))
    print()
    print(gil_table(data))
