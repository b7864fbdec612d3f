"""The caller's loop: ``AsyncEngine`` and what it hands out.

Its ``AsyncLLM`` surface, request streams and their sinks, pacing, metrics,
step readers and argument checks. Nothing here calls the ``LLMEngine``: it
reaches the worker only through ``_bridge``'s inbox.
"""
