"""One model over two "nodes" under the facade: vLLM's multi-node multiprocessing executor.

The two nodes are two process groups on this machine, over loopback: the
head is an ``AsyncEngine`` in this process (``nnodes=2, node_rank=0``, TP=2,
so one rank per node), and the other node is ``examples/multinode.py
--headless`` in a subprocess of its own session, with the same engine
arguments. Greedy tokens are checked against a single-node engine (float32,
as in tests/engine/test_tp.py). The last test kills the headless node and so must
stay last; the fixture kills whatever is left of it, pass or fail.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineDeadError
from support import (
    assert_delta_adds_up,
    assert_reset_keeps_a_running_request,
    assert_same_greedy_tokens,
    cancel_while_iterating,
    child_env,
    drained,
    engine_args,
    free_port,
    result,
    start_engine,
)

# Two nodes of one rank each need two cores; engine starts count against the first test.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.cpu_only,
    pytest.mark.distributed,
    pytest.mark.timeout(600),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multinode.py"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Every node builds its own config from its own arguments; the ranks must agree on
# them, so both nodes get exactly these (and the head the same as EngineArgs).
SHARED = {
    "max_model_len": 512,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "seed": 0,
    "dtype": "float32",  # TP=2 sums in another order than TP=1: see tests/engine/test_tp.py
    # engine_args builds eager on the CPU; a headless node built compiled would
    # wait forever for a head whose ranks never join its compiled warm-up.
    "enforce_eager": True,
}
PROMPTS = (
    "To be or not to be,",
    "It was the best of times, it was the worst of times,",
    "Call me Ishmael.",
)


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set variables for an engine's start: its processes read them once, then restore."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _kill_tree(process: subprocess.Popen[bytes], known: list[psutil.Process]) -> None:
    """SIGKILL the headless node and every process under it, then reap it."""
    with suppress(psutil.NoSuchProcess):
        known = [*known, *psutil.Process(process.pid).children(recursive=True)]
    for proc in known:
        with suppress(psutil.NoSuchProcess):
            proc.kill()
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)
    psutil.wait_procs(known, timeout=30)


@dataclass(frozen=True)
class Headless:
    """The headless node's process (the leader of its own session), port and log."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def single_node(model_path: Path) -> Iterator[AsyncEngine]:
    """The reference: the same model and arguments on one node, without tensor parallelism."""
    began = time.monotonic()
    started = start_engine(engine_args(model_path, **SHARED))
    _START_SECONDS["one node"] = time.monotonic() - began
    yield started
    started.shutdown()


@pytest.fixture(scope="module")
def headless(
    model_path: Path, single_node: AsyncEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Headless]:
    """The second node, ``examples/multinode.py --headless``, started; killed at the end."""
    port = free_port()
    log = tmp_path_factory.mktemp("headless") / "headless.log"
    command = [sys.executable, str(EXAMPLE), "--headless", "--model", str(model_path)]
    command += ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    for name, value in SHARED.items():
        flag = f"--{name.replace('_', '-')}"
        command += [flag] if value is True else [flag, str(value)]
    # The head's rank takes core 0.
    env = child_env(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_OMP_THREADS_BIND="1")
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield Headless(process, port, log)
    finally:
        _kill_tree(process, [])


@pytest.fixture(scope="module")
def two_nodes(model_path: Path, headless: Headless) -> Iterator[AsyncEngine]:
    """The head node: an ``AsyncEngine`` with one rank here and one in the headless node."""
    args = engine_args(
        model_path,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        nnodes=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=headless.port,
        **SHARED,
    )
    before = {p.pid for p in psutil.Process().children()}
    began = time.monotonic()
    with _environ(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_OMP_THREADS_BIND="0"):
        try:
            started = start_engine(args)
        except BaseException:
            print(headless.log_tail())
            raise
    _START_SECONDS["two nodes"] = time.monotonic() - began
    # This engine's processes only: other modules' engines share the session.
    _HEAD[:] = [p for p in psutil.Process().children() if p.pid not in before]
    yield started
    started.shutdown()


_HEAD: list[psutil.Process] = []
"""The head engine's own child processes (its engine core), set by ``two_nodes``."""
_START_SECONDS: dict[str, float] = {}
"""How long each engine's ``start()`` took (the headless node starts meanwhile)."""


def _ranks(root: psutil.Process) -> list[psutil.Process]:
    """vLLM's rank processes under ``root`` (by the name vLLM gives them)."""
    return [p for p in root.children(recursive=True) if "Worker" in p.name()]


async def test_engine_spans_two_nodes(
    two_nodes: AsyncEngine, headless: Headless, figures: Callable[[str], None]
) -> None:
    """The engine has two ranks, one under the head's engine core and one in the headless node."""
    figures(", ".join(f"{name} started in {s:.1f} s" for name, s in _START_SECONDS.items()))
    config = await two_nodes.run_on_engine(lambda e: e.vllm_config.parallel_config)
    assert (config.nnodes, config.world_size) == (2, 2)
    assert await two_nodes.collective_rpc("check_health") == [None, None]
    assert len(_ranks(psutil.Process(headless.process.pid))) == 1
    assert [len(_ranks(core)) for core in _HEAD] == [1]


async def test_greedy_tokens_match_single_node(
    single_node: AsyncEngine, two_nodes: AsyncEngine
) -> None:
    """Greedy decoding over two nodes gives exactly the single-node engine's tokens."""
    await assert_same_greedy_tokens(single_node, two_nodes, PROMPTS)


async def test_delta_stream_concatenates_to_awaited(two_nodes: AsyncEngine) -> None:
    """DELTA iteration over two nodes yields token by token and adds up to the awaited run."""
    await assert_delta_adds_up(two_nodes, PROMPTS[0])


async def test_abort_break_and_cancel(two_nodes: AsyncEngine) -> None:
    """abort(), break and task cancellation each take their request out of the two-node engine."""
    long = SamplingParams(max_tokens=400, **GREEDY)
    async for _ in two_nodes.generate("broken off", long):
        break  # the stream is dropped: this aborts the request
    assert await drained(two_nodes, 200)

    explicit = two_nodes.generate("explicit abort", long)
    await two_nodes.run_on_engine(lambda e: None)  # it is in the engine now
    await two_nodes.abort(explicit.request_id)
    final = await explicit
    assert final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 400

    await cancel_while_iterating(two_nodes.generate("cancelled", long))
    assert await drained(two_nodes, 200)
    assert two_nodes.stats().requests_in_flight == 0


async def test_reset_and_pause(two_nodes: AsyncEngine) -> None:
    """Reset is refused while a request runs, allowed with reset_running_requests; pause holds."""
    await assert_reset_keeps_a_running_request(two_nodes, PROMPTS[1] * 4)


async def test_killed_headless_node_kills_the_engine(
    two_nodes: AsyncEngine, headless: Headless
) -> None:
    """SIGKILL of the headless node's processes ends every stream with EngineDeadError (last)."""
    long = SamplingParams(max_tokens=400, **GREEDY)
    streams = [two_nodes.generate(f"doomed {i}", long) for i in range(3)]
    await two_nodes.run_on_engine(lambda e: None)  # they are in the engine now
    node = psutil.Process(headless.process.pid)
    for proc in [node, *node.children(recursive=True)]:
        proc.send_signal(signal.SIGKILL)
    errors = []
    for stream in streams:
        with pytest.raises(EngineDeadError) as caught:
            await asyncio.wait_for(result(stream), timeout=120)
        errors.append(caught.value)
    for error in errors:
        assert error.__cause__ is not None
        assert type(error.__cause__).__name__ in str(error)
    assert two_nodes.errored
    with pytest.raises(EngineDeadError):
        two_nodes.generate("after death")
