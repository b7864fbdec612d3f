"""The worker thread: the one thread that calls the ``LLMEngine``, and what it alone changes.

Imports ``_bridge`` and the package's leaves, never ``_loop``, ``_pool`` or ``_serve``.
"""
