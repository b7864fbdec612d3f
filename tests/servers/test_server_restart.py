"""The example server with ``--restart``: SSE clients keep streaming across a core kill.

A module of its own, with a server of its own (one engine, ``--restart 2``,
float32 so that the resumed greedy tokens are those of a run without the
kill): the shared server of tests/servers/test_server.py stays as fast as it was.
Its last test stops the server with SIGTERM mid-stream, so it must stay last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from support import Launch, ServerProcess, http_client, served, sse_data

pytestmark = [pytest.mark.engine, pytest.mark.cpu_only, pytest.mark.timeout(900)]

SERVER = Path(__file__).resolve().parents[2] / "examples" / "server.py"
TOKENS = 48


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server with a restart policy, in a subprocess; SIGTERM must stop it cleanly."""
    command = [
        sys.executable,
        str(SERVER),
        *("--host", "127.0.0.1", "--model", str(model_path)),
        *("--max-model-len", "512", "--max-num-seqs", "32", "--seed", "0", "--enforce-eager"),
        *("--dtype", "float32", "--restart", "2", "--disable-log-stats"),
    ]
    # The killed core's replacement is a child too: the launcher waits for it at the end.
    with served(tmp_path_factory.mktemp("server"), server=Launch(command, str(model_path))) as up:
        yield up["server"]


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(server, timeout=300.0) as http:
        yield http


async def stream(
    client: httpx.AsyncClient, prompt: str, first: asyncio.Event | None = None
) -> dict[str, Any]:
    """One SSE completion: its text, finish reason, usage and whether [DONE] came."""
    body = {
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen: dict[str, Any] = {"text": "", "finish": None, "usage": None, "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for data in sse_data(r):
            if data == "[DONE]":
                seen["done"] = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                seen["text"] += choice["text"]
                seen["finish"] = choice["finish_reason"] or seen["finish"]
                if first is not None:
                    first.set()
            seen["usage"] = chunk.get("usage") or seen["usage"]
    return seen


async def test_streams_continue_across_a_core_kill(
    client: httpx.AsyncClient, server: ServerProcess
) -> None:
    """8 SSE clients, the core SIGKILLed mid-stream: all get [DONE], exact usage, same text."""
    prompts = [f"Client {i} streams on" for i in range(8)]
    reference = await asyncio.gather(*(stream(client, p) for p in prompts))
    (core,) = [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if "EngineCore" in p.name()
    ]
    first = asyncio.Event()
    clients = [asyncio.ensure_future(stream(client, p, first)) for p in prompts]
    await first.wait()
    core.kill()
    killed = time.monotonic()
    # /health says degraded while the engine is rebuilt, then ok again.
    statuses: list[str] = []
    while "degraded" not in statuses or statuses[-1] != "ok":
        assert time.monotonic() - killed < 300, statuses
        health = await client.get("/health")
        status = health.json().get("status", "error")
        if not statuses or statuses[-1] != status:
            statuses.append(status)
        await asyncio.sleep(0.1)  # polling the server: there is no event to wait on
    assert statuses[-2:] == ["degraded", "ok"], statuses
    results = await asyncio.gather(*clients)
    for seen, ref in zip(results, reference, strict=True):
        assert seen["done"] and seen["finish"] == "length", seen
        assert seen["usage"]["completion_tokens"] == TOKENS, seen
        assert seen["text"] == ref["text"], (seen["text"], ref["text"])
    stats = (await client.get("/stats")).json()
    assert stats["engines"][0]["restarts"] == 1
    print(f"health across the kill: {statuses}; back after {time.monotonic() - killed:.1f} s")


async def test_models_reports_the_engines_max_model_len(
    client: httpx.AsyncClient, server: ServerProcess
) -> None:
    """/v1/models gives the engine's max_model_len (the flag's 512), after a restart too."""
    models = (await client.get("/v1/models")).json()
    [card] = models["data"]
    assert (card["id"], card["max_model_len"]) == (server.model, 512)


# -- SIGTERM mid-stream (stops the module's server: keep this test last) ---------------------


async def test_sigterm_mid_stream_says_the_server_is_shutting_down(
    client: httpx.AsyncClient, server: ServerProcess
) -> None:
    """SIGTERM with a stream in flight: the stream ends at once with an error event that says
    the server is shutting down, and the server exits cleanly (the launcher checks the rest:
    no traceback, no process left)."""
    body = {"prompt": "Cut me short", "max_tokens": 480, "ignore_eos": True, "stream": True}
    events: list[dict[str, Any]] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for data in sse_data(r):
            if data != "[DONE]":
                events.append(json.loads(data))
                if len(events) == 1:
                    server.process.send_signal(signal.SIGTERM)
    assert len(events) > 1, events
    error = events[-1]["error"]
    assert "shutting down" in error["message"], error
    assert error["type"] == "service_unavailable", error
    code = await asyncio.to_thread(server.process.wait, 120)
    assert code in (0, -signal.SIGTERM), server.log_tail()
