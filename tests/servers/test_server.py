"""The example server (examples/server.py) over real HTTP, with httpx and the openai client.

One server process serves the whole module: two engines (``--engines 2``, an
``AsyncEnginePool``) on the tiny model, an API key, ``--max-pending`` and
``--restart 0`` (every death final, but requests keep the state a rolling
restart continues them from), on a free loopback port; it is stopped at the
end, where it must exit cleanly and leave no process behind. Tests that
stream leave the engines with no unfinished request; the last test kills the
engines and so must stay last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from support import (
    Launch,
    ServerProcess,
    http_client,
    openai_client,
    serve_bench,
    served,
    sse_data,
)

# The server runs as a subprocess with vLLM's default engine settings, sized for this machine.
# Server starts (15-200 s on 2 busy cores) count against the first test's timeout.
pytestmark = [pytest.mark.engine, pytest.mark.cpu_only, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "examples" / "server.py"
LONG = 400  # tokens: far more than a client that disconnects early ever sees
KEY = "example-key"
MAX_PENDING = 210  # above the 200 clients of the load test
ENGINES = 2

Server = ServerProcess


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server in a subprocess, healthy; at the end, SIGTERM must stop it cleanly."""
    command = [
        sys.executable,
        str(SERVER),
        *("--host", "127.0.0.1", "--model", str(model_path)),
        *("--max-model-len", "512", "--max-num-seqs", "32", "--seed", "0", "--enforce-eager"),
        *("--engines", str(ENGINES), "--api-key", KEY, "--max-pending", str(MAX_PENDING)),
        *("--restart", "0", "--disable-log-stats"),
    ]
    with served(tmp_path_factory.mktemp("server"), server=Launch(command, str(model_path))) as up:
        yield up["server"]


@pytest.fixture
async def client(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(server, KEY) as http:
        yield http


@pytest.fixture
async def oai(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(server, KEY) as api:
        yield api


@dataclass
class Streamed:
    """What one streaming client saw."""

    chunks: int = 0
    text: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    done: bool = False  # data: [DONE] received
    left: bool = False  # the client went away before the end


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], leave_after: int | None = None
) -> Streamed:
    """Stream a completion; with ``leave_after``, disconnect after that many chunks."""
    seen = Streamed()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                seen.done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            seen.chunks += 1
            for choice in chunk["choices"]:
                i = choice["index"]
                seen.text[i] = seen.text.get(i, "") + choice["text"]
                if choice["finish_reason"] is not None:
                    seen.finish[i] = choice["finish_reason"]
            if chunk.get("usage"):
                seen.usage = chunk["usage"]
            if leave_after is not None and seen.chunks >= leave_after:
                seen.left = not seen.done
                break  # leaving the block closes the connection mid-body
    return seen


async def _stats(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get("/stats")
    assert r.status_code == 200
    stats: dict[str, Any] = r.json()
    return stats


async def _settled(client: httpx.AsyncClient) -> dict[str, Any]:
    """Stats once no request is in flight (aborts land at the next step boundary)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        stats = await _stats(client)
        if stats["requests_in_flight"] == 0 and stats["commands_queued"] == 0:
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"requests still in flight: {stats}")


# -- answers -------------------------------------------------------------------------


async def test_health_stats_and_models(client: httpx.AsyncClient, server: Server) -> None:
    """/health answers ok, /stats has the totals and every engine's stats, /v1/models the model."""
    from asynckv import EngineStats

    r = await client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "draining": []})
    stats = await _stats(client)
    assert len(stats["engines"]) == ENGINES
    assert all(set(engine) == set(EngineStats._fields) for engine in stats["engines"])
    assert stats["requests_in_flight"] == 0
    models = (await client.get("/v1/models")).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(server.model, 512)]


async def test_completion(client: httpx.AsyncClient, server: Server) -> None:
    """A JSON completion has OpenAI's shape, the model's name and exact usage."""
    body = {"prompt": "To be or not to be,", "max_tokens": 8, "temperature": 0.0}
    r = await client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "text_completion"
    assert answer["model"] == server.model
    assert answer["id"].startswith("cmpl-")
    [choice] = answer["choices"]
    assert (choice["index"], choice["finish_reason"]) == (0, "length")
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["prompt_tokens"] > 0
    assert answer["usage"]["total_tokens"] == 8 + answer["usage"]["prompt_tokens"]


async def test_openai_client(oai: openai.AsyncOpenAI, server: Server) -> None:
    """The openai client reads both answers, and greedy streaming spells the same text."""
    args: dict[str, Any] = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = await oai.completions.create(**args)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12

    stream = await oai.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        assert chunk.model == server.model
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    assert text == whole.choices[0].text


async def test_n2(client: httpx.AsyncClient, oai: openai.AsyncOpenAI, server: Server) -> None:
    """n=2 gives two complete choices, as JSON and streamed."""
    body = {"prompt": "Two ways", "max_tokens": 10, "n": 2, "seed": 3, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 20

    seen = await _stream(client, {**body, "stream_options": {"include_usage": True}})
    assert seen.done and seen.finish == {0: "length", 1: "length"}
    assert seen.usage is not None and seen.usage["completion_tokens"] == 20

    finished: dict[int, str] = {}
    stream = await oai.completions.create(
        model=server.model, prompt="Two ways", max_tokens=10, n=2, stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1}


async def test_reset_during_streaming(client: httpx.AsyncClient) -> None:
    """Resets while streams run: refused without, done with reset_running_requests; all end."""
    body = {"prompt": "Reset under me", "max_tokens": LONG, "ignore_eos": True}
    before = await _stats(client)
    first_chunks = asyncio.Semaphore(0)

    async def consume(i: int) -> Streamed:
        seen = Streamed()
        request = {**body, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=request) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    seen.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line.removeprefix("data: "))
                    seen.chunks += 1
                    if seen.chunks == 1:
                        first_chunks.release()
                    for choice in chunk["choices"]:
                        seen.finish[choice["index"]] = choice["finish_reason"]
                    seen.usage = chunk.get("usage") or seen.usage
        return seen

    tasks = [asyncio.create_task(consume(i)) for i in range(4)]
    for _ in tasks:
        await first_chunks.acquire()
    refused = await client.post("/reset_prefix_cache", json={"reset_running_requests": False})
    assert (refused.status_code, refused.json()) == (200, {"reset": False})
    done = await client.post("/reset_prefix_cache", json={"reset_running_requests": True})
    assert (done.status_code, done.json()) == (200, {"reset": True})
    results = await asyncio.gather(*tasks)
    for seen in results:
        assert seen.done and seen.finish == {0: "length"}
        assert seen.usage is not None and seen.usage["completion_tokens"] == LONG
    after = await _settled(client)
    assert after["requests_aborted"] == before["requests_aborted"]
    idle = await client.post("/reset_prefix_cache")  # no body: reset_running_requests=False
    assert idle.json() == {"reset": True}


# -- bad input -----------------------------------------------------------------------

# vLLM's CompletionRequest parses the body: its own checks, and its lax JSON ("8" is 8),
# with unknown fields ignored (and logged) as vLLM's own server ignores them.
BAD_BODIES: list[tuple[str | bytes, str]] = [
    ("not json", "not valid JSON"),
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8"),  # Latin-1, say
    ('{"prompt": "\\ud800 alone"}', "lone surrogate (U+D800 at character 0)"),
    ('{"prompt": ["fine", "also \\udfff"]}', "lone surrogate (U+DFFF at character 5)"),
    ("[1, 2]", "expected a JSON object"),
    ("{}", "prompt"),
    ('{"prompt": ""}', "prompt"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": 42}', "prompt"),
    ('{"prompt": ["x", [1, 2]]}', "prompt"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt": "x", "top_p": 0}', "top_p"),
    ('{"prompt": "x", "n": 0}', "n must be at least 1"),
    ('{"prompt": "x", "stop": [""]}', "stop"),
    ('{"prompt": "x", "seed": 1.5}', "seed"),
    ('{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    ('{"prompt": "x", "max_tokens": 1180591620717411303424}', "serialize ints"),
    ('{"prompt": "x", "logprobs": 100}', "logprobs"),
    ('{"prompt": "x", "suffix": "y"}', "suffix"),
]


@pytest.mark.parametrize(("body", "message"), BAD_BODIES)
async def test_bad_body(client: httpx.AsyncClient, body: str | bytes, message: str) -> None:
    """A body that doesn't validate gets a 400 whose message names the problem."""
    r = await client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]


ODD_BODIES: list[dict[str, Any]] = [
    {"max_tokens": "8"},
    {"max_token": 8},
    {"seed": -(2**63)},
    {"seed": 2**63 - 1},
    {"prompt": "nul \u0000 and emoji \U0001f600 and <s></s><unk>"},
    {"temperature": 1e-30, "top_p": 1e-9},
    {"n": 16},
    {"stop": ["e", "a", "o"]},
    {"max_tokens": 2**31 - 1},
]


@pytest.mark.parametrize("extra", ODD_BODIES)
async def test_odd_but_valid_body(client: httpx.AsyncClient, extra: dict[str, Any]) -> None:
    """Edge values the body allows are served, and the engine stays healthy."""
    body = {"prompt": "Edge", "max_tokens": 4, **extra}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == body.get("n", 1)
    assert (await client.get("/health")).status_code == 200


async def test_bad_reset_body(client: httpx.AsyncClient) -> None:
    """/reset_prefix_cache validates its body too."""
    r = await client.post("/reset_prefix_cache", json={"reset_running_requests": "yes"})
    assert r.status_code == 400
    assert "reset_running_requests" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_too_long(client: httpx.AsyncClient, stream: bool) -> None:
    """A prompt longer than the model takes is the engine's 400, streamed or not."""
    r = await client.post("/v1/completions", json={"prompt": "word " * 600, "stream": stream})
    assert r.status_code == 400, r.text
    assert "maximum context length" in r.json()["error"]["message"]
    assert (await client.get("/health")).status_code == 200


async def test_unknown_model_and_path_are_openai_404s(
    client: httpx.AsyncClient, oai: openai.AsyncOpenAI
) -> None:
    """A model other than the one served gets vllm serve's 404; an unknown path OpenAI's shape."""
    r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("NotFoundError", "model")
    assert error["message"].startswith("The model `nope` does not exist.")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await oai.completions.create(model="nope", prompt="x", max_tokens=1)
    for method, path in (("GET", "/v1/nope"), ("GET", "/v1/completions")):
        r = await client.request(method, path)
        assert r.status_code in (404, 405), r.text
        assert r.json()["error"]["type"] == "invalid_request_error", r.text


async def test_openai_client_sees_400(oai: openai.AsyncOpenAI, server: Server) -> None:
    """The openai client raises BadRequestError with the server's message."""
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await oai.completions.create(model=server.model, prompt="x", max_tokens=0)


# -- the whole completions body -------------------------------------------------------------


async def test_several_prompts_and_vllm_extras(client: httpx.AsyncClient) -> None:
    """Lists of prompts (text or token ids), n, penalties, logit_bias, user and vLLM's extras."""
    body = {
        "prompt": ["Hello", "World"],
        "n": 2,
        "max_tokens": 3,
        "seed": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "logit_bias": {"5": -100},
        "user": "someone",
        "top_k": 5,
        "min_tokens": 3,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
    }
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]  # prompt * n + i
    assert answer["usage"]["completion_tokens"] == 4 * 3

    ids = {"prompt": [[1, 40, 41], [1, 50]], "max_tokens": 2, "ignore_eos": True}
    r = await client.post("/v1/completions", json=ids)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5
    single = await client.post("/v1/completions", json={**ids, "prompt": [1, 40, 41]})
    assert len(single.json()["choices"]) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_and_logprobs(client: httpx.AsyncClient, model_path: Path, stream: bool) -> None:
    """echo prepends the prompt; logprobs score its tokens too, with offsets into the text."""
    from tokenizers import Tokenizer

    # Whole-character tokens only (vLLM's allowed_token_ids), so token texts spell the text.
    words = Tokenizer.from_file(str(model_path / "tokenizer.json")).encode("the cat sat on a mat")
    body = {
        "prompt": "Hello",
        "max_tokens": 4,
        "echo": True,
        "logprobs": 2,
        "ignore_eos": True,
        "allowed_token_ids": words.ids[1:],
    }
    text, tokens, offsets, top = "", [], [], []
    if stream:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line.removeprefix("data: "))["choices"]:
                        text += choice["text"]
                        tokens += choice["logprobs"]["tokens"]
                        offsets += choice["logprobs"]["text_offset"]
                        top += choice["logprobs"]["top_logprobs"]
    else:
        r = await client.post("/v1/completions", json=body)
        [choice] = r.json()["choices"]
        text, logprobs = choice["text"], choice["logprobs"]
        tokens, offsets, top = logprobs["tokens"], logprobs["text_offset"], logprobs["top_logprobs"]
    assert text.startswith("Hello")
    generated = list(zip(tokens, offsets, strict=True))[-4:]
    assert len(tokens) > 4 and top[0] is None  # the prompt's tokens, the first unscored
    for token, offset in generated:
        assert text[offset : offset + len(token)] == token
    assert all(len(t) <= 3 for t in top[1:])  # the sampled token and the 2 most likely


def test_vllm_bench_serve(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own benchmark client (the random dataset, streaming) completes every request."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    opts = argparse.Namespace(input_len=32, output_len=8, seed=0, logs=None)
    got = serve_bench().client(server.url, server.model, 4, 16, opts)
    assert (got["completed"], got["failed"]) == (16, 0), got


# -- limits and the pool -----------------------------------------------------------------------


async def test_api_key(server: Server) -> None:
    """Without the key /v1 and /admin answer 401; /health and /stats stay open."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as anonymous:
        r = await anonymous.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        wrong = {"Authorization": "Bearer nope"}
        assert (await anonymous.get("/v1/models", headers=wrong)).status_code == 401
        assert (await anonymous.post("/admin/rolling_restart")).status_code == 401
        assert (await anonymous.get("/health")).status_code == 200
        assert (await anonymous.get("/stats")).status_code == 200


async def test_max_pending_answers_429(client: httpx.AsyncClient) -> None:
    """Beyond --max-pending completions in flight, 429 with Retry-After; then served again.

    The engines are paused, so the completions that hold the places wait, each
    counted, until the test resumes them.
    """
    assert (await client.post("/pause", json={"mode": "wait"})).json() == {"paused": True}

    async def hold(i: int) -> Streamed:
        return await _stream(client, {"prompt": f"Hold {i}", "max_tokens": 4, "ignore_eos": True})

    holders = [asyncio.create_task(hold(i)) for i in range(MAX_PENDING)]
    deadline = time.monotonic() + 60.0
    while (await _stats(client))["requests_waiting"] < MAX_PENDING:
        assert time.monotonic() < deadline, await _stats(client)
        await asyncio.sleep(0.05)
    refused = await client.post("/v1/completions", json={"prompt": "one more"})
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit"
    assert (await client.get("/health")).status_code == 200
    assert (await client.post("/resume")).json() == {"paused": False}
    for seen in await asyncio.gather(*holders):
        assert seen.done and seen.finish == {0: "length"}, seen
    await _settled(client)
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200


async def test_pool_spreads_requests(client: httpx.AsyncClient) -> None:
    """With --engines 2 a burst of requests is served by both engines of the pool."""
    before = [e["requests_finished"] for e in (await _settled(client))["engines"]]
    bodies = [{"prompt": f"Spread {i}", "max_tokens": 16, "ignore_eos": True} for i in range(8)]
    answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in answers)
    after = [e["requests_finished"] for e in (await _settled(client))["engines"]]
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 8 and all(n > 0 for n in served), served


# -- load and disconnects ------------------------------------------------------------


async def test_load_with_disconnects(client: httpx.AsyncClient) -> None:
    """200 concurrent streams, 30% leaving early: the rest complete, the leavers are aborted."""
    rng = random.Random(7)
    clients = 200
    leavers = set(rng.sample(range(clients), k=clients * 30 // 100))
    chunks_seen = {i: rng.randint(1, 5) for i in leavers}  # before leaving
    lengths = {i: rng.randint(32, 64) for i in range(clients)}
    before = await _settled(client)

    async def one(i: int) -> Streamed:
        if i in leavers:
            body = {"prompt": f"Client {i} leaves", "max_tokens": LONG, "ignore_eos": True}
            return await _stream(client, body, leave_after=chunks_seen[i])
        body = {
            "prompt": f"Client {i} stays",
            "max_tokens": lengths[i],
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        seen = await _stream(client, body)
        assert seen.usage is not None
        assert seen.usage["completion_tokens"] == body["max_tokens"], (i, seen)
        return seen

    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, (await _stats(client))["requests_in_flight"])
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    watcher.cancel()
    assert peak > 32, peak  # more clients than --max-num-seqs were in the engine at once
    for i, seen in enumerate(results):
        if i in leavers:
            assert seen.left and not seen.done, (i, seen)
        else:
            assert seen.done and seen.finish == {0: "length"}, (i, seen)
    after = await _settled(client)
    assert after["requests_in_flight"] == 0
    assert after["requests_aborted"] - before["requests_aborted"] == len(leavers), after
    finished = after["requests_finished"] - before["requests_finished"]
    assert finished == clients, after  # aborted requests end with a final output too
    print(f"{clients} clients in {elapsed:.1f} s, at most {peak} requests in flight")


# -- a rolling restart ----------------------------------------------------------------

ROLLED = 32  # SSE clients through the roll
ROLL_TOKENS = 384  # long enough that both members' drains find streams in flight


async def test_rolling_restart_keeps_every_sse_client(client: httpx.AsyncClient) -> None:
    """POST /admin/rolling_restart under 32 SSE clients: every one gets its whole completion,
    [DONE] and exact usage; /health names the member being drained; both engines restart."""
    prompts = [f"Client {i} rolls on and on" for i in range(ROLLED)]
    # Each prompt's token count, for the exact usage: one token of each, before the roll.
    short = {"max_tokens": 1, "temperature": 0.0}
    counted = await asyncio.gather(
        *(client.post("/v1/completions", json={**short, "prompt": p}) for p in prompts)
    )
    prompt_tokens = [r.json()["usage"]["prompt_tokens"] for r in counted]
    before = [e["restarts"] for e in (await _settled(client))["engines"]]
    started = asyncio.Semaphore(0)

    async def one(prompt: str) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "max_tokens": ROLL_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        seen: dict[str, Any] = {"started": False, "text": "", "finish": None, "usage": None}
        seen["done"] = False
        async with client.stream("POST", "/v1/completions", json=body, timeout=600) as r:
            assert r.status_code == 200, await r.aread()
            async for data in sse_data(r):
                if data == "[DONE]":
                    seen["done"] = True
                    continue
                chunk = json.loads(data)
                assert "error" not in chunk, chunk
                if not seen["started"]:
                    seen["started"] = True
                    started.release()
                for choice in chunk["choices"]:
                    seen["text"] += choice["text"]
                    seen["finish"] = choice["finish_reason"] or seen["finish"]
                seen["usage"] = chunk.get("usage") or seen["usage"]
        return seen

    clients = [asyncio.create_task(one(p)) for p in prompts]
    for _ in prompts:
        await started.acquire()
    draining: list[list[int]] = []
    rolling = asyncio.Event()

    async def watch() -> None:
        while True:
            health = await client.get("/health")
            assert health.status_code == 200, health.text  # the pool serves throughout
            now = health.json()["draining"]
            if not draining or draining[-1] != now:
                draining.append(now)
            if now:
                rolling.set()
            await asyncio.sleep(0.05)  # polling the server: there is no event to wait on

    watcher = asyncio.create_task(watch())
    began = time.monotonic()
    roll = asyncio.create_task(
        client.post("/admin/rolling_restart", json={"handoff": True}, timeout=600)
    )
    try:
        await asyncio.wait_for(rolling.wait(), 60)
        busy = await client.post("/admin/rolling_restart")
        assert busy.status_code == 409, busy.text  # one roll at a time
        assert busy.json()["error"]["message"] == "a rolling restart is already running"
        rolled = await roll
    finally:
        watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher  # raises what the watcher found, if anything
    assert rolled.status_code == 200, rolled.text
    members = rolled.json()["members"]
    assert [m["index"] for m in members] == [0, 1], members
    assert members[0]["moved"] > 0 and members[0]["stayed"] == 0, members
    results = await asyncio.gather(*clients)
    for seen, count in zip(results, prompt_tokens, strict=True):
        assert seen["done"] and seen["finish"] == "length", seen
        usage = {"prompt_tokens": count, "completion_tokens": ROLL_TOKENS}
        assert seen["usage"] == {**usage, "total_tokens": count + ROLL_TOKENS}, seen
    assert [0] in draining and [1] in draining, draining
    assert (await client.get("/health")).json() == {"status": "ok", "draining": []}
    after = await _settled(client)
    assert [e["restarts"] - b for e, b in zip(after["engines"], before, strict=True)] == [1, 1]
    seconds = time.monotonic() - began
    print(f"rolled in {seconds:.1f} s: {members}; /health said draining: {draining}")


# -- a dead engine (kills the module's engine: keep this test last) -----------------


async def test_dead_engine_is_503(client: httpx.AsyncClient, server: Server) -> None:
    """Once the engine-core processes die, streams end with an error event; then 503s."""
    cores = [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if "EngineCore" in p.name()
    ]
    assert cores, "no engine-core process found"
    events: list[str] = []
    body = {"prompt": "Still there?", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    for core in cores:
                        core.kill()
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["type"] == "service_unavailable"
    assert "the engine died" in error["message"]

    # Each engine's watchdog sees its own engine-core process die, a moment apart.
    deadline = time.monotonic() + 30.0
    while (health := await client.get("/health")).status_code == 200:
        assert time.monotonic() < deadline, "an engine still answers"
        await asyncio.sleep(0.1)
    assert health.status_code == 503, health.text
    assert "the engine died" in health.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"prompt": "anyone there?"})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "service_unavailable"
    r = await client.post("/reset_prefix_cache")
    assert r.status_code == 503, r.text
    assert (await client.get("/stats")).status_code == 200
