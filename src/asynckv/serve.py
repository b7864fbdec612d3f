"""``python -m asynckv.serve``, on the main thread: vLLM's own OpenAI server on asynckv.

Takes every ``vllm serve`` flag (parsed by vLLM's own parser) and serves every
``vllm serve`` endpoint, on an ``AsyncEngine`` instead of vLLM's ``AsyncLLM``::

    python -m asynckv.serve --model PATH [any vllm serve flag] [--max-pending N]

Without a model it serves asynckv's demo model (``asynckv.testing.demo_model``)
as ``demo``, with a chat template, so ``/v1/chat/completions`` works offline.
``--host`` defaults to 127.0.0.1. See docs/server.md. ``main`` runs on the main
thread, which it gives to the server's event loop until the server stops.
"""

from __future__ import annotations

from ._serve._server import build_app, main, parse_args

__all__ = ("build_app", "main", "parse_args")

if __name__ == "__main__":  # vLLM spawns engine processes: the guard is required
    main()
