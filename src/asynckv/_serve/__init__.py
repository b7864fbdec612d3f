"""Serving, on the server's event loop: ``AsyncEngineClient`` and vLLM's OpenAI server on it.

``AsyncEngineClient`` is vLLM's ``EngineClient`` on an ``AsyncEngine``; it
runs on the server's event loop.
"""
