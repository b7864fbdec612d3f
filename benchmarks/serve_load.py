"""A fixed load on an OpenAI completions endpoint: how many tokens a second it serves.

Runs on one event loop: ``--clients`` concurrent clients, each sending
``--requests`` completions one after the other, every one with its own
prompt (so no two share a prefix), ``--max-tokens`` tokens each with
``ignore_eos``. Prints one JSON line: wall time, requests and completion
tokens a second. docs/scaling.md compares two Ray Serve replicas with one
under the same load (examples/ray_serve.py)::

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model PATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import httpx

__all__ = ("main", "run")


async def run(
    url: str, model: str, clients: int, requests: int, max_tokens: int
) -> dict[str, float]:
    """Apply the load once; return its figures."""
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for _ in range(requests):
            body = {
                "model": model,
                "prompt": f"{uuid.uuid4().hex} tell me a story",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            response = await http.post("/v1/completions", json=body)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        began = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.monotonic() - began
    return {
        "clients": clients,
        "requests": clients * requests,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 2),
        "requests_per_s": round(clients * requests / wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
    }


def main() -> None:
    """Parse the flags, apply the load, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    figures = asyncio.run(run(args.url, args.model, args.clients, args.requests, args.max_tokens))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
