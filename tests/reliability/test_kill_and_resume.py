"""Restart and resume on real engines: the engine core SIGKILLed under load, once and again.

One module engine (float32, a restart policy) serves the exactness test: a
reference run without a kill, then the same requests with the core killed
at a random step. The tiny model stores bfloat16 weights; float32 makes the
prefill of prompt + generated tokens (the resume) compute what the decode
steps computed. Each restart costs an engine start (20-60 s on 2 busy CPU
cores), so the module holds two and a half: one for the exactness test, and
one and the start of another for the death test's own engine.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psutil
import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, EngineDeadError, RequestStream, RestartPolicy
from asynckv._vllm import engine_processes
from support import engine_args, unfinished

# Engine starts and restarts take 20-90 s each on 2 busy cores; the first test also starts one.
pytestmark = pytest.mark.timeout(900)

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
DELTA = SamplingParams(
    max_tokens=64, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)
# vLLM refuses n > 1 with temperature 0; top_k=1 samples the greedy token every time.
TWO = SamplingParams(n=2, max_tokens=64, temperature=1.0, top_k=1, ignore_eos=True)

# Recovery times measured by this module's tests, for the figures line.
_RECOVERIES: list[float] = []


def prompts(n: int, seed: int) -> list[TokensPrompt]:
    rng = random.Random(seed)
    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(260, 500) for _ in range(rng.randint(16, 64))])
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def restarting(model_path: Path) -> Iterator[AsyncEngine]:
    """An engine that restarts (float32, so that a resume computes what decoding did)."""
    engine = AsyncEngine.from_engine_args(
        # 96 sequences at once: every stream of the test is in flight at the kill.
        engine_args(model_path, dtype="float32", max_num_seqs=96),
        restart=RestartPolicy(max_restarts=5, window=600.0),
    )
    asyncio.run(engine.start())
    yield engine
    engine.shutdown()


async def core_pid(engine: AsyncEngine) -> int:
    """The pid of the engine's engine-core process now."""
    (pid,) = await engine.run_on_engine(lambda e: [p.pid for p in engine_processes(e)])
    assert isinstance(pid, int)
    return pid


async def collect(
    stream: RequestStream, delta: bool, engine: AsyncEngine, seen: list[tuple[float, int]]
) -> RequestOutput:
    """Iterate ``stream``, noting when each output came and the engine's restarts then.

    Returns the final output (for DELTA, the merge of them all).
    """
    merged: RequestOutput | None = None
    async for out in stream:
        seen.append((time.monotonic(), engine.stats().restarts))
        if delta and merged is not None:
            merged.add(out, aggregate=True)
        else:
            merged = out
    assert merged is not None
    return merged


async def kill_at(engine: AsyncEngine, stream: RequestStream, tokens: int) -> float:
    """SIGKILL the engine core once ``stream``'s output has ``tokens`` tokens; the time then."""
    pid = await core_pid(engine)
    async for out in stream:
        if len(out.outputs[0].token_ids) >= tokens:
            break
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def is_delta(params: SamplingParams) -> bool:
    return params.output_kind is RequestOutputKind.DELTA


def completions(out: RequestOutput) -> list[tuple[list[int], str]]:
    return [(list(c.token_ids), c.text) for c in sorted(out.outputs, key=lambda c: c.index)]


def divergence(out: RequestOutput, ref: RequestOutput) -> tuple[int | None, int | None, str, str]:
    """Where ``out`` first differs from ``ref``: the token and character (None: nowhere)."""

    def first(a: Sequence[object], b: Sequence[object]) -> int | None:
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        return min(len(a), len(b)) if at is None and len(a) != len(b) else at

    mine, theirs = out.outputs[0], ref.outputs[0]
    token = first(list(mine.token_ids), list(theirs.token_ids))
    char = first(mine.text, theirs.text)
    around = slice(max(0, (char or 0) - 8), (char or 0) + 8)
    return token, char, mine.text[around], theirs.text[around]


async def run_and_kill(
    engine: AsyncEngine, work: list[tuple[TokensPrompt, SamplingParams]], at: int
) -> tuple[list[RequestOutput], float, float]:
    """Run ``work`` with the core killed after ``at`` tokens of a watcher stream.

    Returns the finals, the recovery time (from the kill to the first output
    of the new engine) and the time from the kill to the last final output.
    """
    times: list[list[tuple[float, int]]] = [[] for _ in work]
    watcher = engine.generate(work[0][0], SamplingParams(max_tokens=64, ignore_eos=True))
    streams = [engine.generate(p, s) for p, s in work]
    restarts = engine.stats().restarts
    tasks = [
        asyncio.ensure_future(collect(s, params.output_kind is RequestOutputKind.DELTA, engine, t))
        for s, t, (_, params) in zip(streams, times, work, strict=True)
    ]
    killed = await kill_at(engine, watcher, at)
    await watcher.aclose()
    finals = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    done = time.monotonic()
    assert engine.stats().restarts == restarts + 1
    recovered = min(t for each in times for t, r in each if r > restarts) - killed
    _RECOVERIES.append(recovered)
    assert all(s.metrics is not None and s.metrics.restarts == 1 for s in streams)
    return finals, recovered, done - killed


async def test_streams_resume_exactly(
    restarting: AsyncEngine, figures: Callable[[str], None]
) -> None:
    """50 greedy, 10 n=2 and 10 DELTA streams, the core SIGKILLed at a random step: as without.

    Every stream completes with its exact token count, and the token ids and
    text of each completion are those of a run without the kill.
    """
    greedy = [(p, GREEDY) for p in prompts(50, seed=14)]
    others = [(p, TWO) for p in prompts(10, seed=15)] + [(p, DELTA) for p in prompts(10, seed=16)]
    work = greedy + others
    reference = await asyncio.gather(
        *(
            collect(
                restarting.generate(p, s), s.output_kind is RequestOutputKind.DELTA, restarting, []
            )
            for p, s in work
        )
    )
    at = random.Random(14).randrange(4, 40)
    finals, recovered, total = await run_and_kill(restarting, work, at)
    for final, ref, (_, params) in zip(finals, reference, work, strict=True):
        assert len(final.outputs) == params.n
        assert all(len(c.token_ids) == 64 and c.finish_reason == "length" for c in final.outputs)
        assert final.prompt_token_ids == ref.prompt_token_ids
    same = [completions(f) == completions(r) for f, r in zip(finals, reference, strict=True)]
    assert all(same), [
        (i, *divergence(f, r))
        for i, (f, r) in enumerate(zip(finals, reference, strict=True))
        if not same[i]
    ]
    assert await unfinished(restarting) == 0
    figures(
        f"50 greedy + 10 n=2 + 10 DELTA streams x 64 tokens, core SIGKILLed after {at} tokens: "
        f"{sum(same)}/70 identical (ids and text); the new engine's first output "
        f"{recovered:.1f} s after the kill, all done {total:.1f} s after it"
    )


async def test_kills_beyond_the_policy(model_path: Path, figures: Callable[[str], None]) -> None:
    """Three deaths, the last a kill during a restart: every stream ends naming each death."""
    engine = AsyncEngine.from_engine_args(
        engine_args(model_path), restart=RestartPolicy(max_restarts=2, window=600.0)
    )
    await engine.start()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    streams = [engine.generate(p, long) for p in prompts(8, seed=17)]
    # The first kill, then the engine is back.
    killed = await kill_at(engine, engine.generate("watch", long), 2)
    async for _ in streams[0]:
        if engine.stats().restarts == 1:  # an output of the new engine
            break
    _RECOVERIES.append(time.monotonic() - killed)
    assert engine.stats().restarts == 1
    # The second kill; then the third, of the new core while it starts.
    old = {p.pid for p in psutil.Process().children(recursive=True)}
    os.kill(await core_pid(engine), signal.SIGKILL)
    began = time.monotonic()
    starting = None
    while starting is None and time.monotonic() - began < 120:
        new = [
            p for p in psutil.Process().children() if p.pid not in old and "EngineCore" in p.name()
        ]
        starting = new[0] if new else None
        await asyncio.sleep(0.05)  # polling another process: no event to wait on
    assert starting is not None, "no new engine core started"
    starting.kill()
    for stream in streams:
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(stream, 120)
        assert len(info.value.deaths) == 3
    message = str(info.value)
    assert message.count("killed by SIGKILL") == 2, message
    assert "1) ChildProcessError" in message and "3) " in message
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    await engine.aclose()
    figures(f"3 deaths (the last a kill of the core starting again): {message[:160]}...")
    if _RECOVERIES:
        figures(
            f"recovery (kill to first output) over {len(_RECOVERIES)} restarts: median "
            f"{statistics.median(_RECOVERIES):.1f} s, max {max(_RECOVERIES):.1f} s"
        )
