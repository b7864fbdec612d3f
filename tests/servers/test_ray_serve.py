"""Replicas under Ray Serve (examples/ray_serve.py) on a local two-node Ray cluster.

One cluster serves the whole module: ``ray start --head`` and a second
``ray start`` on this machine, each a "node" of one logical CPU with its
own core for its engine (``VLLM_CPU_OMP_THREADS_BIND``), and the example's
application deployed on it, two replicas, one per node. Requests go through
Serve's HTTP proxy. Every process of the cluster carries an environment
variable with this run's token, which is how the last test finds orphans:
after ``serve.shutdown()`` and ``ray stop`` no process may carry it. The
fixture stops the cluster (and kills what carries the token) pass or fail.
The kill test and the shutdown test change the cluster and so stay last.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from support import child_env, free_port

# Cluster and replica starts (tens of seconds each on 2 cores) count against the first test.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.cpu_only,
    pytest.mark.distributed,
    pytest.mark.timeout(600),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_serve.py"
TOKEN_VAR = "ASYNCKV_RAY_TEST"
# Tokens: a stream that outlasts the test's steps (the tiny model makes ~100-200 a second).
LONG = 1900
MAX_MODEL_LEN = 2048  # the tiny model's max_position_embeddings


@dataclass
class Cluster:
    """The running cluster: Ray's address, Serve's URL, the model, and this run's token."""

    address: str
    url: str
    model: str
    token: str
    env: dict[str, str]
    log: Path
    started_s: float  # the Serve application's deploy time, replicas included

    def processes(self) -> list[psutil.Process]:
        """Every process on this machine that carries this cluster's token."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(TOKEN_VAR) == self.token:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        with self.log.open("a") as out:
            return subprocess.run(
                args, env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, text=True
            )


def _ray(cluster_env: dict[str, str], log: Path, *args: str, **env: str) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    with log.open("a") as out:
        subprocess.run(
            [ray, *args],
            env={**cluster_env, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=180,
            check=True,
        )


def _stop(cluster: Cluster) -> list[psutil.Process]:
    """``ray stop``, then wait for the token's processes to go; return those that stayed."""
    ray = str(Path(sys.executable).with_name("ray"))
    cluster.run(ray, "stop", timeout=120)
    _, alive = psutil.wait_procs(cluster.processes(), timeout=60)
    return list(alive)


@pytest.fixture(scope="module")
def cluster(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The two-node cluster with the application deployed; stopped and swept at the end."""
    log = tmp_path_factory.mktemp("ray") / "ray.log"
    token = uuid.uuid4().hex
    env = child_env(
        **{TOKEN_VAR: token},
        RAY_USAGE_STATS_ENABLED="0",
        # Older Rays' switch for killing what a dead worker leaves (its engine); Ray 2.60
        # kills the worker's process group anyway and logs this switch as deprecated.
        RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper="true",
    )
    port, http_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    common = (
        "--num-cpus",
        "1",
        "--object-store-memory",
        "200000000",
        "--node-ip-address",
        "127.0.0.1",
    )
    made = Cluster(address, f"http://127.0.0.1:{http_port}", str(model_path), token, env, log, 0.0)
    head = ["start", "--head", "--port", str(port), "--include-dashboard=false"]
    vllm_flags = ["--model", str(model_path), "--max-model-len", str(MAX_MODEL_LEN)]
    vllm_flags += ["--max-num-seqs", "32", "--seed", "0", "--enforce-eager"]
    try:
        _ray(env, log, *head, "--disable-usage-stats", *common, VLLM_CPU_OMP_THREADS_BIND="0")
        _ray(env, log, "start", "--address", address, *common, VLLM_CPU_OMP_THREADS_BIND="1")
        began = time.monotonic()
        deployed = made.run(
            *(sys.executable, str(EXAMPLE), "--address", address, "--replicas", "2"),
            *("--http-port", str(http_port), "--", *vllm_flags),
        )
        made.started_s = time.monotonic() - began
        assert deployed.returncode == 0, log.read_text()[-4000:]
        yield made
    finally:
        left = _stop(made)
        for proc in left:
            proc.kill()


def _replica(response: httpx.Response) -> tuple[str, int]:
    replica, pid = response.headers["x-asynckv-replica"].split()
    return replica, int(pid)


def _completion(cluster: Cluster, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens}
    response = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def _all_stats(cluster: Cluster, replicas: int = 2) -> dict[str, dict[str, int]]:
    """``GET /stats`` until every replica answered (those go by load); each one's answer."""
    seen: dict[str, dict[str, int]] = {}
    for _ in range(200):
        response = httpx.get(f"{cluster.url}/stats", timeout=60)
        assert response.status_code == 200, response.text
        seen[_replica(response)[0]] = response.json()
        if len(seen) == replicas:
            return seen
    pytest.fail(f"only replicas {sorted(seen)} answered /stats")


def _replica_processes(cluster: Cluster) -> list[psutil.Process]:
    return [p for p in cluster.processes() if "ServeReplica:asynckv:OpenAIReplica" in p.name()]


def test_two_replicas_on_two_nodes(cluster: Cluster, figures: Callable[[str], None]) -> None:
    """The openai client gets completions through Serve; two replicas, under two raylets."""
    figures(f"Serve application deployed (2 replicas) in {cluster.started_s:.1f} s")
    with openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120.0
    ) as api:
        done = api.completions.create(
            model=cluster.model, prompt="Hello", max_tokens=8, temperature=0.0
        )
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 8
        chunks = list(
            api.completions.create(
                model=cluster.model, prompt="Hello", max_tokens=8, temperature=0.0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    replicas = _replica_processes(cluster)
    assert len(replicas) == 2
    parents = {p.parent().name() for p in replicas}
    assert parents == {"raylet"}
    assert len({p.ppid() for p in replicas}) == 2  # one per node


def test_prefix_affinity(cluster: Cluster) -> None:
    """Requests sharing a long prefix go to one replica; a new prompt to the emptier one."""
    first = "A long shared system prompt about ships and whales. " * 4
    second = "Ein ganz anderer Anfang, ueber Berge und Taeler im Winter. " * 4
    seen: dict[str, set[str]] = {first: set(), second: set()}
    for i in range(4):
        for prefix in (first, second):
            seen[prefix].add(_replica(_completion(cluster, f"{prefix} question {i}?"))[0])
    assert [len(s) for s in seen.values()] == [1, 1], seen


def test_disconnect_aborts_in_the_replica(cluster: Cluster) -> None:
    """A client that leaves a stream early aborts its request in the replica's engine."""
    body = {
        "model": cluster.model,
        "prompt": "disconnect " + uuid.uuid4().hex,
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    before = _all_stats(cluster)
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        replica = _replica(response)[0]
        chunks = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks += 1
                if chunks == 3:
                    break  # leaving the block closes the connection
    aborted = before[replica]["requests_aborted"]
    for _ in range(100):
        stats = _all_stats(cluster)[replica]
        if stats["requests_aborted"] > aborted and stats["requests_in_flight"] == 0:
            break
        time.sleep(0.2)
    assert stats["requests_aborted"] == aborted + 1, stats
    assert stats["requests_in_flight"] == 0
    # It ended by the abort alone (an aborted request counts as finished too).
    assert stats["requests_finished"] == before[replica]["requests_finished"] + 1


def test_killed_replica_is_restarted(cluster: Cluster) -> None:
    """A replica killed under load fails its streams in flight; Serve starts a new one."""
    body = {
        "model": cluster.model,
        "prompt": "doomed " + uuid.uuid4().hex,
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    lines: list[str] = []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as response:
        replica, pid = _replica(response)
        victim = psutil.Process(pid)
        doomed = victim.children(recursive=True)  # its engine's processes
        # The stream is cut short: the connection breaks, or it ends without [DONE].
        with contextlib.suppress(httpx.HTTPError):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        victim.send_signal(signal.SIGKILL)
    assert "data: [DONE]" not in lines
    assert len(lines) < LONG
    # The raylet kills the dead worker's process group, its engine's processes with it.
    _, alive = psutil.wait_procs(doomed, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
    # Serve notices, starts a replica with a new id (its engine too), and routes to it.
    deadline = time.monotonic() + 300
    answered: set[str] = set()
    while time.monotonic() < deadline and len(answered - {replica}) < 2:
        response = httpx.get(f"{cluster.url}/stats", timeout=60)
        if response.status_code == 200:
            answered.add(_replica(response)[0])
        time.sleep(0.5)
    assert len(answered - {replica}) == 2, answered
    assert len(_replica_processes(cluster)) == 2


def test_shutdown_leaves_no_process(cluster: Cluster) -> None:
    """serve.shutdown() stops every replica and its engine; ray stop leaves nothing behind."""
    replicas = _replica_processes(cluster)
    engines = [p for r in replicas for p in r.children(recursive=True) if "EngineCore" in p.name()]
    shutdown = cluster.run(sys.executable, str(EXAMPLE), "--address", cluster.address, "--shutdown")
    assert shutdown.returncode == 0, cluster.log.read_text()[-4000:]
    _, alive = psutil.wait_procs(engines + replicas, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
    left = _stop(cluster)
    assert not left, [(p.pid, p.name()) for p in left]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{cluster.url}/stats", timeout=5)
