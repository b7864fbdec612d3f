"""The pool's routing, on the caller's thread: prefix affinity and load, per engine.

Runs on the caller's thread. ``AsyncEnginePool`` calls everything here with
its lock held, except ``PrefixIndex.keys`` (pure, on the prompt alone).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._loop._engine import AsyncEngine
    from .._loop._stream import RequestStream

__all__ = ("PrefixIndex", "Router")


class PrefixIndex:
    """Chained hashes of whole prompt blocks, mapped to the engine that served them.

    Blocks are ``block_tokens`` tokens of a ``TokensPrompt`` or
    ``block_chars`` characters of a text prompt; a LoRA adapter or
    ``cache_salt`` is part of the first hash, as in vLLM's cache. The latest
    ``max_prefixes`` blocks are kept, least recently used forgotten first.
    """

    def __init__(self, block_tokens: int, block_chars: int, max_prefixes: int) -> None:
        if min(block_tokens, block_chars, max_prefixes) < 1:
            raise ValueError("block_tokens, block_chars and max_prefixes must be >= 1")
        self._block_tokens = block_tokens
        self._block_chars = block_chars
        self._max_prefixes = max_prefixes
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # block-chain hash -> engine

    def forget(self, engine_done: Callable[[int], bool]) -> None:
        """Forget the prefixes of the engines for which ``engine_done(index)`` is true."""
        self.prefixes = OrderedDict(
            (key, index) for key, index in self.prefixes.items() if not engine_done(index)
        )

    def match(self, keys: Sequence[int]) -> int | None:
        # A block's hash covers every block before it, so the first miss ends the match.
        found = None
        for key in keys:
            index = self.prefixes.get(key)
            if index is None:
                break
            found = index
        return found

    def remember(self, keys: Sequence[int], index: int) -> None:
        prefixes = self.prefixes
        # Leaves first, so a prompt's first blocks end up most recent and the
        # least-recently-used end evicts leaves before the roots that lead to them.
        for key in reversed(keys):
            prefixes[key] = index
            prefixes.move_to_end(key)
        while len(prefixes) > self._max_prefixes:
            prefixes.popitem(last=False)

    def keys(self, prompt: Any, kwargs: Mapping[str, Any]) -> list[int]:
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


class Router:
    """Picks an engine per request: see ``AsyncEnginePool``'s docstring for the rule."""

    def __init__(self, engines: Sequence[AsyncEngine], slack: int, prefixes: PrefixIndex) -> None:
        self._engines = engines
        self._slack = slack
        self.prefixes = prefixes
        # Per engine, the pool's requests on it. Weak, so that dropping a stream
        # still aborts its request (the stream's own guarantee).
        self._streams: list[dict[str, weakref.ref[RequestStream]]] = [{} for _ in engines]
        self._cursor = 0
        self.draining: frozenset[int] = frozenset()
        """The members being drained (``pool.drain``): no request is routed to them.
        Replaced whole, under the pool's lock."""

    def track(
        self, index: int, request_id: str, stream: RequestStream, keys: Sequence[int]
    ) -> None:
        """Note that engine ``index`` took this request (and so holds its prefixes)."""
        self._streams[index][request_id] = weakref.ref(stream)
        self.prefixes.remember(keys, index)

    def move(self, request_id: str, old: int, new: int) -> None:
        """Note that engine ``new`` took over this request from engine ``old`` (failover)."""
        ref = self._streams[old].pop(request_id, None)
        if ref is not None:
            self._streams[new][request_id] = ref

    def owner(self, request_id: str) -> int | None:
        """The engine serving this request of the pool's, if its stream is unfinished."""
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

    def choose(self, keys: Sequence[int], refused: set[int]) -> int | None:
        """The engine for a request with these prefix keys (None if every one is dead).

        ``refused``: engines that refused it since (they died or were closed).
        A member being drained is never chosen.
        """
        live = [
            i
            for i, engine in enumerate(self._engines)
            if i not in refused and i not in self.draining and not engine.errored
        ]
        # An engine being rebuilt (its RestartPolicy) takes requests only if no other can:
        # they would wait for the rebuild.
        serving = [i for i in live if not self._engines[i].restarting]
        live = serving or live
        if not live:
            return None
        load = {i: self._load(i) for i in live}
        count = len(self._engines)
        least = min(live, key=lambda i: (load[i], (i - self._cursor) % count))
        preferred = self.prefixes.match(keys)
        if preferred in load and load[preferred] <= load[least] + self._slack:
            return preferred
        self._cursor = (least + 1) % count
        return least
