"""AsyncEnginePool: several engines behind one ``generate`` / ``abort`` / reset API.

A pool is for data parallelism without a shared executor: each ``AsyncEngine``
is a whole model replica (one per GPU, say), with its own worker thread and
prefix cache. The pool only routes: it picks an engine per request and then
gets out of the way, so a stream from the pool is that engine's own stream.

Everything here runs on the caller's thread, usually an event loop. The
routing state (who serves which request, which engine saw which prefix) sits
behind one ``threading.Lock`` held only for bookkeeping and a non-blocking
``engine.generate``, so a pool serves any number of loops, as an engine does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._engine import AsyncEngine
from ._errors import EngineClosedError, EngineDeadError

if TYPE_CHECKING:
    from types import TracebackType

    from vllm import EngineArgs
    from vllm.sampling_params import SamplingParams

    from ._stream import RequestStream

__all__ = ("AsyncEnginePool",)


class AsyncEnginePool:
    """Several ``AsyncEngine``s behind the API of one, routing each request to one of them.

    **Routing.** A request goes to the live engine that served the longest
    prefix of its prompt before, so that engine's prefix cache can hit, unless
    that engine's load exceeds the least-loaded live engine's by more than
    ``affinity_slack``; then, and when no prefix matches, it goes to the
    least-loaded live engine, ties broken round-robin. An engine's load is the
    number of requests the pool has in flight on it, or its own
    ``stats().requests_in_flight + requests_waiting`` if larger (that one also
    counts requests submitted to the engine directly). Prefixes are compared
    in whole blocks: ``block_tokens`` tokens of a ``TokensPrompt``, or
    ``block_chars`` characters of a text prompt (no tokenizing on the loop;
    about four characters make a token). A different LoRA adapter or
    ``cache_salt`` never matches, as in vLLM's cache. The pool remembers the
    latest ``max_prefixes`` blocks, least recently used forgotten first.

    **Failures.** An engine that dies (``engine.errored``) fails its own
    streams with ``EngineDeadError``, as it would alone; the pool sends no new
    request to it and keeps serving from the others. Only when every engine
    is dead do ``generate`` and ``reset_prefix_cache`` raise ``EngineDeadError``.

    The pool owns its engines: ``start()`` starts them all, ``aclose()`` closes
    them all. Build one with ``AsyncEnginePool.from_engine_args([...])`` or
    around engines you made, ``AsyncEnginePool([engine, ...])``.
    """

    def __init__(
        self,
        engines: Iterable[AsyncEngine],
        *,
        affinity_slack: int = 8,
        block_tokens: int = 16,
        block_chars: int = 64,
        max_prefixes: int = 65_536,
    ) -> None:
        self._engines = tuple(engines)
        if not self._engines:
            raise ValueError("a pool needs at least one engine")
        if affinity_slack < 0:
            raise ValueError("affinity_slack must be >= 0")
        if min(block_tokens, block_chars, max_prefixes) < 1:
            raise ValueError("block_tokens, block_chars and max_prefixes must be >= 1")
        self._slack = affinity_slack
        self._block_tokens = block_tokens
        self._block_chars = block_chars
        self._max_prefixes = max_prefixes
        self._lock = threading.Lock()
        # Per engine, the pool's requests on it. Weak, so that dropping a stream
        # still aborts its request (the stream's own guarantee).
        self._streams: list[dict[str, weakref.ref[RequestStream]]] = [{} for _ in self._engines]
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # block-chain hash -> engine
        self._cursor = 0
        self._closed = False

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Iterable[EngineArgs],
        *,
        affinity_slack: int = 8,
        block_tokens: int = 16,
        block_chars: int = 64,
        max_prefixes: int = 65_536,
        freeze_gc: bool = True,
    ) -> AsyncEnginePool:
        """Make a pool of one engine per ``EngineArgs``; ``start()`` builds them all.

        Does no heavy work. ``freeze_gc`` is ``AsyncEngine``'s; the other
        keyword arguments are those of ``AsyncEnginePool``.
        """
        return cls(
            [AsyncEngine.from_engine_args(args, freeze_gc=freeze_gc) for args in engine_args],
            affinity_slack=affinity_slack,
            block_tokens=block_tokens,
            block_chars=block_chars,
            max_prefixes=max_prefixes,
        )

    @property
    def engines(self) -> tuple[AsyncEngine, ...]:
        """The engines, in the order given; ``engine_of`` indexes into this."""
        return self._engines

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Start every engine, concurrently, and wait until all are ready.

        If any engine fails to start, every engine is closed once all have
        settled, and the first failure is raised: nothing is left running.
        A no-op for engines already started.
        """
        self._check_open()
        try:
            results = await asyncio.gather(
                *(engine.start() for engine in self._engines), return_exceptions=True
            )
        except BaseException:
            await self.aclose()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.aclose()
            raise errors[0]

    async def aclose(self, timeout: float = 30.0) -> None:
        """Close every engine, concurrently (see ``AsyncEngine.aclose``). Idempotent."""
        self._closed = True
        await asyncio.gather(*(engine.aclose(timeout) for engine in self._engines))

    async def __aenter__(self) -> AsyncEnginePool:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError()

    # -- requests ------------------------------------------------------------------

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Route a request to an engine (see the class docstring), submit it, return its stream.

        Everything ``AsyncEngine.generate`` promises holds: the request is in
        that engine's inbox on return, the stream belongs to the running loop,
        and a bad request raises from the stream. ``engine_of(request_id)``
        tells which engine took it.

        Raises:
            ValueError: ``request_id`` is already in flight in the pool, on any
                engine (raised here, unlike a single engine, which raises it
                from the stream, because the pool knows all its ids).
            TypeError: ``sampling_params`` or ``request_id`` has the wrong type.
            EngineDeadError: every engine is dead.
            EngineClosedError, EngineNotStartedError: at once.
        """
        rid = uuid.uuid4().hex if request_id is None else request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, not {type(rid).__name__}")
        keys = self._prefix_keys(prompt, kwargs)
        with self._lock:
            self._check_open()
            if self._owner(rid) is not None:
                raise ValueError(f"request id {rid!r} is already in flight in the pool")
            refused: set[int] = set()
            while True:
                index = self._choose(keys, refused)
                try:
                    stream = self._engines[index].generate(prompt, sampling_params, rid, **kwargs)
                except (EngineDeadError, EngineClosedError):
                    # It died (or was closed on its own) since the check: nothing
                    # was submitted, so another engine can take the request.
                    refused.add(index)
                    continue
                break
            self._streams[index][rid] = weakref.ref(stream)
            self._remember(keys, index)
        return stream

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests on the engines that serve them; return once all are out.

        As ``AsyncEngine.abort``: each stream ends with a final "abort" output.
        Ids the pool has not in flight (unknown, finished, or submitted to an
        engine directly) are ignored, and so are engines that died meanwhile
        (their streams have already failed).
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError("request ids must be str")
        self._check_open()
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for rid in ids:
                index = self._owner(rid)
                if index is not None:
                    by_engine.setdefault(index, []).append(rid)
        await asyncio.gather(
            *(self._abort_on(self._engines[i], group) for i, group in by_engine.items())
        )

    @staticmethod
    async def _abort_on(engine: AsyncEngine, ids: list[str]) -> None:
        # A dead or closed engine has already ended its streams with that error.
        with contextlib.suppress(EngineDeadError, EngineClosedError):
            await engine.abort(ids)

    def engine_of(self, request_id: str) -> int | None:
        """The index in ``engines`` of the engine serving ``request_id``.

        None unless the request was submitted through the pool and its stream
        has not ended yet.
        """
        with self._lock:
            return self._owner(request_id)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> list[bool]:
        """Reset every engine's prefix cache, concurrently; return each engine's answer.

        The list follows ``engines``; each answer is ``AsyncEngine.reset_prefix_cache``'s,
        and False for a dead engine. The pool forgets the prefixes of the
        engines that answered True, since their caches no longer hold them.

        Raises:
            EngineDeadError: every engine is dead.
            EngineClosedError: the pool was closed.
        """
        self._check_open()
        if all(engine.errored for engine in self._engines):
            raise self._all_dead()
        results = list(
            await asyncio.gather(
                *(
                    self._reset_one(engine, reset_running_requests, reset_connector)
                    for engine in self._engines
                )
            )
        )
        with self._lock:
            self._prefixes = OrderedDict(
                (key, index) for key, index in self._prefixes.items() if not results[index]
            )
        return results

    @staticmethod
    async def _reset_one(engine: AsyncEngine, running: bool, connector: bool) -> bool:
        try:
            return await engine.reset_prefix_cache(running, connector)
        except (EngineDeadError, EngineClosedError):
            return False

    # -- routing, with the lock held -------------------------------------------------

    def _owner(self, request_id: str) -> int | None:
        for index, streams in enumerate(self._streams):
            ref = streams.get(request_id)
            if ref is not None:
                stream = ref()
                if stream is not None and not stream.finished:
                    return index
                del streams[request_id]
        return None

    def _load(self, index: int) -> int:
        streams = self._streams[index]
        # Drop what ended. Linear in the requests in flight, which is fine for
        # a few hundred per engine; the engine's own counters can't replace it,
        # since a request submitted a moment ago may not be admitted yet.
        ended = [rid for rid, ref in streams.items() if (s := ref()) is None or s.finished]
        for rid in ended:
            del streams[rid]
        stats = self._engines[index].stats()
        return max(len(streams), stats.requests_in_flight + stats.requests_waiting)

    def _choose(self, keys: Sequence[int], refused: set[int]) -> int:
        live = [
            i for i, engine in enumerate(self._engines) if i not in refused and not engine.errored
        ]
        if not live:
            raise self._all_dead()
        load = {i: self._load(i) for i in live}
        count = len(self._engines)
        least = min(live, key=lambda i: (load[i], (i - self._cursor) % count))
        preferred = self._match(keys)
        if preferred in load and load[preferred] <= load[least] + self._slack:
            return preferred
        self._cursor = (least + 1) % count
        return least

    def _all_dead(self) -> BaseException:
        dead = [
            error
            for engine in self._engines
            if engine.errored and isinstance(error := engine.dead_error, Exception)
        ]
        if not dead:
            return EngineClosedError()  # every engine was closed on its own
        return EngineDeadError(ExceptionGroup("every engine in the pool is dead", dead))

    def _match(self, keys: Sequence[int]) -> int | None:
        # A block's hash covers every block before it, so the first miss ends the match.
        found = None
        for key in keys:
            index = self._prefixes.get(key)
            if index is None:
                break
            found = index
        return found

    def _remember(self, keys: Sequence[int], index: int) -> None:
        prefixes = self._prefixes
        # Leaves first, so a prompt's first blocks end up most recent and the
        # least-recently-used end evicts leaves before the roots that lead to them.
        for key in reversed(keys):
            prefixes[key] = index
            prefixes.move_to_end(key)
        while len(prefixes) > self._max_prefixes:
            prefixes.popitem(last=False)

    # -- prefixes, without the lock ------------------------------------------------

    def _prefix_keys(self, prompt: Any, kwargs: Mapping[str, Any]) -> list[int]:
        """The chained hashes of the prompt's whole blocks; empty if it has no text or tokens.

        Python's ``hash`` is enough: a collision only misroutes one request.
        """
        salt = None
        if isinstance(prompt, Mapping):
            salt = prompt.get("cache_salt")
            if (ids := prompt.get("prompt_token_ids")) is not None:
                units: Sequence[Any] = list(ids)
                block, kind = self._block_tokens, "tokens"
            elif isinstance(text := prompt.get("prompt"), str):
                units, block, kind = text, self._block_chars, "text"
            else:
                return []
        elif isinstance(prompt, str):
            units, block, kind = prompt, self._block_chars, "text"
        else:
            return []
        lora = kwargs.get("lora_request")
        chain = hash((kind, salt, getattr(lora, "lora_int_id", None)))
        keys = []
        for start in range(0, len(units) - block + 1, block):
            chunk = units[start : start + block]
            chain = hash((chain, chunk if isinstance(chunk, str) else tuple(chunk)))
            keys.append(chain)
        return keys
