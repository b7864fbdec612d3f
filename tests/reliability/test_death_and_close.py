"""Engine death, close under load, Ctrl-C and a hung step: everything ends, nothing is left."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import psutil
import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineClosedError, EngineDeadError
from fakes import FakeEngine, hold_in_next_step
from support import child_processes, engine_args

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def _asynckv_threads() -> int:
    return sum(t.name.startswith("asynckv-") and t.is_alive() for t in threading.enumerate())


async def _ending(awaitable: object) -> BaseException | None:
    try:
        await awaitable  # type: ignore[misc]
    except BaseException as exc:
        return exc
    return None


async def test_killed_engine_core_under_load(
    model_path: Path, figures: Callable[[str], None]
) -> None:
    """SIGKILL with 50 streams and pending commands: all end with EngineDeadError within 5 s."""
    before = child_processes()
    engine = AsyncEngine.from_engine_args(engine_args(model_path))
    await engine.start()
    (core,) = {p.pid for p in psutil.Process().children() if "EngineCore" in p.name()} - before
    streams = [engine.generate(f"doomed {i}", LONG) for i in range(50)]
    await engine.run_on_engine(lambda e: None)
    os.kill(core, signal.SIGKILL)
    commands: list[asyncio.Future[object]] = [
        asyncio.ensure_future(engine.run_on_engine(lambda e: None)) for _ in range(5)
    ]
    # Commands that call into the dead core (a reset waits for its answer) fail too.
    commands += [asyncio.ensure_future(engine.reset_prefix_cache()) for _ in range(5)]
    began = time.monotonic()
    endings = await asyncio.wait_for(
        asyncio.gather(*(_ending(s) for s in streams), *(_ending(c) for c in commands)), 5
    )
    seconds = time.monotonic() - began
    stream_endings, command_endings = endings[:50], endings[50:]
    assert all(isinstance(e, EngineDeadError) for e in stream_endings), stream_endings
    # A command the worker ran before the death was seen succeeded; all others failed.
    assert all(e is None or isinstance(e, EngineDeadError) for e in command_endings)
    dead = [e for e in endings if e is not None]
    assert all("killed by SIGKILL" in str(e) for e in dead)
    assert all(isinstance(e.__cause__, ChildProcessError) for e in dead)
    with pytest.raises(EngineDeadError):
        engine.generate("new")
    closing = time.monotonic()
    await asyncio.wait_for(engine.aclose(), 10)
    assert not (child_processes() - before)
    figures(
        f"50 streams + 10 commands ended in {seconds:.2f} s after SIGKILL; "
        f"aclose {time.monotonic() - closing:.2f} s; no child left"
    )


async def test_step_raises_under_load(figures: Callable[[str], None]) -> None:
    """A fake step() raising with 50 streams: all end with EngineDeadError naming the cause."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    streams = [engine.generate(f"r{i}", SamplingParams(max_tokens=10**6)) for i in range(50)]
    await engine.run_on_engine(lambda e: None)
    fake.fail_with = OSError("device lost")
    endings = await asyncio.wait_for(asyncio.gather(*(_ending(s) for s in streams)), 5)
    assert all(isinstance(e, EngineDeadError) and "OSError: device lost" in str(e) for e in endings)
    assert all(isinstance(e.__cause__, OSError) for e in endings if e is not None)
    await asyncio.wait_for(engine.aclose(), 5)
    figures("50 streams ended with EngineDeadError(OSError) after a raising step")


async def test_close_under_load(model_path: Path, figures: Callable[[str], None]) -> None:
    """aclose() with 100 streams and queued commands: everything answered, nothing left."""
    before = child_processes()
    threads = _asynckv_threads()
    engine = AsyncEngine.from_engine_args(engine_args(model_path))
    await engine.start()
    streams = [engine.generate(f"busy {i}", LONG) for i in range(100)]
    await engine.run_on_engine(lambda e: None)
    commands = [asyncio.ensure_future(engine.reset_prefix_cache()) for _ in range(20)]
    await asyncio.sleep(0)  # the commands are queued
    began = time.monotonic()
    await engine.aclose()
    seconds = time.monotonic() - began
    endings = await asyncio.gather(*(_ending(s) for s in streams), *(_ending(c) for c in commands))
    assert all(e is None or isinstance(e, EngineClosedError) for e in endings), endings
    assert not (child_processes() - before)
    assert _asynckv_threads() == threads  # the worker is joined, the watchdog gone
    await engine.aclose()  # a no-op
    figures(f"aclose with 100 streams + 20 commands: {seconds:.2f} s, all answered")


async def test_hung_step(figures: Callable[[str], None]) -> None:
    """A step that blocks for 30 s: aclose(timeout=5) returns within 6 s, streams end."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    streams = [engine.generate(f"r{i}", SamplingParams(max_tokens=10**6)) for i in range(10)]
    await hold_in_next_step(engine, fake)
    began = time.monotonic()
    await asyncio.wait_for(engine.aclose(timeout=5), 6)
    seconds = time.monotonic() - began
    endings = await asyncio.gather(*(_ending(s) for s in streams))
    assert all(isinstance(e, EngineClosedError) for e in endings)
    fake.gate.set()
    figures(f"aclose(timeout=5) with a hung step returned in {seconds:.2f} s")


SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import EngineArgs, SamplingParams
    from asynckv import AsyncEngine

    async def main(close: bool) -> None:
        args = EngineArgs(model=sys.argv[1], max_model_len=512, enforce_eager=True)
        engine = AsyncEngine.from_engine_args(args)
        await engine.start()
        streams = [engine.generate(f"p{i}", SamplingParams(max_tokens=400, ignore_eos=True))
                   for i in range(8)]
        async for _ in streams[0]:
            print("STREAMING", flush=True)
            break
        if close:
            async with engine:
                await asyncio.sleep(3600)  # until Ctrl-C
        # else: return with the engine open and streams in flight

    if __name__ == "__main__":
        asyncio.run(main(sys.argv[2] == "close"))
    """
)


@pytest.mark.cpu_only  # the script's engine is sized for this machine (eager: see engine_args)
@pytest.mark.parametrize("how", ["ctrl-c", "no-close"])
def test_script_exits_cleanly(
    how: str, model_path: Path, tmp_path: Path, figures: Callable[[str], None]
) -> None:
    """A script interrupted by SIGINT, or returning without closing, exits within 10 s.

    It leaves no engine process behind, and (without closing) prints no traceback.
    """
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    mode = "close" if how == "ctrl-c" else "leave"
    errors = (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model_path), mode],
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # vLLM logs to stdout too
        if "STREAMING" in line:
            break
    else:
        pytest.fail(f"the script ended before streaming: {_tail(errors)}")
    tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    began = time.monotonic()
    if how == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)
    stderr = _tail(errors)
    seconds = time.monotonic() - began
    _, alive = psutil.wait_procs([psutil.Process(p) for p in tree if psutil.pid_exists(p)], 5)
    assert not alive, alive
    if how == "no-close":
        assert proc.returncode == 0
        assert "Traceback" not in stderr, stderr
    figures(
        f"{how}: exit code {proc.returncode} in {seconds:.1f} s, {len(tree)} children, none left"
    )


def _tail(errors: TextIO) -> str:
    errors.flush()
    errors.seek(0)
    return errors.read()[-4000:]
