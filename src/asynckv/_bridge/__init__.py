"""Both threads: what crosses between the callers' loops and the worker.

The inbox and the commands the loops send, the outbox of answers back, and
the loop handles (asyncio, trio) the worker posts to. Nothing here calls the
``LLMEngine``, and nothing here imports another room.
"""
