"""Pool failover on real engines: one member's engine core SIGKILLed under load.

Two float32 engines with a restart policy (float32 so that the requests
resumed on the other member compute the tokens the first would have). The
killed member's requests finish on the live one with the tokens of a run
without the kill; the member restarts in the background and rejoins.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm import SamplingParams

from asynckv import AsyncEnginePool, RestartPolicy
from asynckv._vllm import engine_processes
from support import engine_args, random_prompts

# Two engine starts and a restart, on 2 busy cores.
pytestmark = pytest.mark.timeout(900)

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


async def test_killed_member_fails_over_and_rejoins(
    model_path: Path, figures: Callable[[str], None]
) -> None:
    """Kill one member's core under 24 streams: all finish exactly, on the other; it rejoins."""
    args = engine_args(model_path, dtype="float32")
    pool = AsyncEnginePool.from_engine_args(
        [args, args], restart=RestartPolicy(max_restarts=2, window=600.0)
    )
    async with pool:
        work = random_prompts(24, seed=41)
        reference = await asyncio.gather(*(pool.generate(p, GREEDY) for p in work))
        streams = [pool.generate(p, GREEDY, request_id=f"s{i}") for i, p in enumerate(work)]
        moved = [i for i in range(len(work)) if pool.engine_of(f"s{i}") == 0]
        assert moved and len(moved) < len(work)
        first = pool.engines[0]
        (pid,) = await first.run_on_engine(lambda e: [p.pid for p in engine_processes(e)])
        assert isinstance(pid, int)
        async for out in streams[moved[0]]:
            if len(out.outputs[0].token_ids) >= 8:
                break
        finished_before = pool.engines[1].stats().requests_finished
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        finals = await asyncio.wait_for(asyncio.gather(*streams), 300)
        done = time.monotonic() - killed
        for final, ref in zip(finals, reference, strict=True):
            assert list(final.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
            assert final.outputs[0].text == ref.outputs[0].text
        assert all(streams[i].metrics.restarts == 1 for i in moved)  # type: ignore[union-attr]
        # The moved requests finished on the live member, while the other was rebuilt.
        assert pool.engines[1].stats().requests_finished - finished_before >= len(moved)
        # The member rejoins: a call waits for its rebuild, then new requests reach it.
        await asyncio.wait_for(first.run_on_engine(lambda e: None), 300)
        back = time.monotonic() - killed
        assert not first.restarting and first.stats().restarts == 1
        await pool.check_health()
        later = [pool.generate(p, GREEDY, request_id=f"l{i}") for i, p in enumerate(work[:4])]
        assert {pool.engine_of(f"l{i}") for i in range(4)} == {0, 1}
        await asyncio.gather(*later)
    figures(
        f"{len(moved)} of 24 streams failed over after a SIGKILL of member 0's core: all 24 "
        f"identical to a run without it, done {done:.1f} s after the kill; member 0 back "
        f"after {back:.1f} s"
    )
