"""The reset-KV example, end to end on the demo model, against a sync ``LLMEngine`` loop.

Both versions run: ``reset_kv_async`` (asyncio) and ``reset_kv_trio``, which
must report and print the same.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm import EngineArgs, LLMEngine, SamplingParams

import reset_kv_async
import reset_kv_trio
from asynckv.testing import demo_model

# The example builds its engine from vLLM's default settings, sized for this machine.
pytestmark = [pytest.mark.engine, pytest.mark.cpu_only]

ROBOT = "A robot may not injure a human being " * 50
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example() -> tuple[reset_kv_async.Report, str]:
    """One run of the example with no arguments (the demo model), and what it printed."""
    lines: list[str] = []
    report = reset_kv_async.main([], echo=lines.append)
    return report, "\n".join(lines)


@pytest.fixture(scope="module")
def trio_example() -> tuple[reset_kv_async.Report, str]:
    """One run of the trio version with no arguments, and what it printed."""
    lines: list[str] = []
    report = reset_kv_trio.main([], echo=lines.append)
    return report, "\n".join(lines)


@pytest.fixture(scope="module")
def sync_engine() -> Iterator[LLMEngine]:
    """A plain in-process ``LLMEngine`` on the demo model, stepped by the test itself."""
    from vllm.v1.executor import Executor

    config = EngineArgs(model=str(demo_model())).create_engine_config()
    engine = LLMEngine(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
        multiprocess_mode=False,
    )
    yield engine
    engine.engine_core.shutdown()


def run_documented_schedule(engine: LLMEngine, reset_at: int | None) -> dict[str, list[int]]:
    """Follow vLLM's reset-KV example: one prompt added per step, a reset before step 11.

    Returns the token ids of the two greedy requests.
    """
    greedy = SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16)
    to_add = [
        (ROBOT, greedy),
        (ROBOT, greedy),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, max_tokens=128)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, max_tokens=128)),
    ]
    finished: dict[str, list[int]] = {}
    step = 0
    while to_add or engine.has_unfinished_requests():
        if to_add:
            prompt, params = to_add.pop(0)
            engine.add_request(str(3 - len(to_add)), prompt, params)
        if step == reset_at:
            assert engine.reset_prefix_cache(reset_running_requests=True)
        for out in engine.step():
            if out.finished and out.request_id in ("0", "1"):
                finished[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    # Leave no cached blocks behind for the next run.
    assert engine.reset_prefix_cache()
    return finished


def check_output(report: reset_kv_async.Report, printed: str) -> None:
    """The checks of one run's report and printed output (either version)."""
    assert [r.request_id for r in report.requests] == ["0", "1", "2", "3"]
    assert [r.added_at_step for r in report.requests] == [0, 1, 2, 3]
    assert all(r.output.finished for r in report.requests)
    assert [len(r.output.outputs) for r in report.requests] == [1, 1, 1, 2]
    assert all(c.token_ids for r in report.requests for c in r.output.outputs)
    assert report.reset.result is True
    assert report.reset.step == reset_kv_async.RESET_AT_STEP == 10
    # The greedy requests (16 tokens from step 1 and 2) are still running at step 10.
    assert report.reset.running[:2] == ["0", "1"]
    assert report.requests[0].running_at_reset

    for rid in "0123":
        assert f"request {rid} finished" in printed
    assert printed.count("  completion 1: ") == 1
    assert "returned True at step 10" in printed


def test_example_output(example: tuple[reset_kv_async.Report, str]) -> None:
    """Four requests finish, the n=2 one with two completions, and the reset succeeds at step 10."""
    check_output(*example)


def test_trio_example_reports_and_prints_the_same(
    example: tuple[reset_kv_async.Report, str], trio_example: tuple[reset_kv_async.Report, str]
) -> None:
    """The trio version passes the same checks, prints alike and gets the same greedy tokens."""
    check_output(*trio_example)

    def shape(printed: str) -> list[str]:
        # The lines with what may differ between two runs masked: figures,
        # sampled text, finish reasons and yes/no. Sorted: finishing order varies.
        masks = [
            (r": (['\"]).*$", ": TEXT"),
            (r"-?\d+(\.\d+)?", "#"),
            (r"\b(length|stop|abort|yes|no)\b", "WORD"),
        ]
        lines = []
        for line in printed.splitlines():
            for pattern, mask in masks:
                line = re.sub(pattern, mask, line)
            lines.append(line)
        return sorted(lines)

    assert shape(trio_example[1]) == shape(example[1])
    greedy = [
        [list(r.output.outputs[0].token_ids) for r in run[0].requests[:2]]
        for run in (example, trio_example)
    ]
    assert greedy[0] == greedy[1]


def test_greedy_tokens_match_sync_loop_and_no_reset(
    example: tuple[reset_kv_async.Report, str], sync_engine: LLMEngine
) -> None:
    """The greedy requests get the same tokens async, in a sync loop, and without the reset."""
    greedy = example[0].requests[:2]
    async_tokens = {r.request_id: list(r.output.outputs[0].token_ids) for r in greedy}
    with_reset = run_documented_schedule(sync_engine, reset_at=10)
    without_reset = run_documented_schedule(sync_engine, reset_at=None)
    assert len(async_tokens["0"]) == 16
    assert async_tokens["0"] == async_tokens["1"]
    assert async_tokens == with_reset == without_reset


def shown_output(path: Path, after: str) -> tuple[str, str]:
    """The first ``text`` block after the heading ``after`` in ``path``, and the text after it."""
    text = path.read_text()
    rest = text[text.index(after) :]
    start = rest.index("```text\n") + len("```text\n")
    end = rest.index("```\n", start)
    return rest[start:end].rstrip("\n"), rest[end:]


def fixed_part(printed: str) -> list[str]:
    """The printed lines, with what the README says varies by machine masked; sorted.

    Masked: the completions of requests 0, 1 and 3 (text, logprob, length and
    finish reason) and the timings. Sorted: requests 2 and 3 may finish in
    either order.
    """
    lines, request = [], ""
    for line in printed.splitlines():
        if match := re.match(r"request (\d) finished", line):
            request = match[1]
        if line.startswith("  completion") and request in ("0", "1", "3"):
            line = re.sub(r"^(  completion \d+): .*$", r"\1: VARIES", line)
        lines.append(re.sub(r"\d+\.\d+ s\b", "# s", line))
    return sorted(lines)


def test_readme_shows_this_output_but_for_what_it_says_varies(
    example: tuple[reset_kv_async.Report, str],
) -> None:
    """The README's (and docs/example.md's) output is this run's, but for the parts it names.

    What it says varies by machine (the demo model's text for requests 0, 1
    and 3, the timings) is masked; the rest, request 2's recital included,
    must be what this run printed.
    """
    shown, after = shown_output(ROOT / "README.md", "## Running the example")
    assert "vary by machine" in " ".join(after.split()[:80])
    assert fixed_part(shown) == fixed_part(example[1])
    assert shown_output(ROOT / "docs" / "example.md", "## Output")[0] == shown
