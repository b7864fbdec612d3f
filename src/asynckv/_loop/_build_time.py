"""What the ``LLMEngine`` set when it was built, and ``AsyncLLM``'s properties that read it.

``BuildRecord.record`` runs on the worker thread, right after the build and
before the worker answers ``start()`` (or on the caller's thread, at once,
for an engine built by the caller). The properties of
``BuildTimeAttributes`` (``vllm_config``, ``model_config``, ``renderer``,
``input_processor``, ``tokenizer``) and ``get_tokenizer`` run on any
thread: they read only what the engine set when it was built and never
changes after. vLLM's own server reads the renderer from its loop while the
worker runs, as it does with ``AsyncLLM``, whose renderer tokenizes on its
own thread pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import EngineClosedError, EngineNotStartedError

if TYPE_CHECKING:
    from vllm import LLMEngine
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers import BaseRenderer
    from vllm.v1.engine.input_processor import InputProcessor

    from .._worker._worker import Worker

__all__ = ("BuildRecord", "BuildTimeAttributes")


@dataclass(frozen=True, slots=True)
class _BuildTime:
    """What the ``LLMEngine`` set when it was built: it never changes after."""

    vllm_config: VllmConfig
    renderer: BaseRenderer
    input_processor: InputProcessor


class BuildRecord:
    """Keeps what the ``LLMEngine`` set at build time, for the loop side to read.

    Filled once, on the worker thread, right after the build and before the
    worker answers ``start()`` (or at once for an engine built by the caller);
    read on the loop only after that answer, so the loop sees it complete. It
    holds the engine's configs and renderer, not the engine itself.
    """

    __slots__ = ("built",)

    def __init__(self, engine: LLMEngine | None = None) -> None:
        self.built: _BuildTime | None = None
        if engine is not None:
            self.record(engine)

    def record(self, engine: LLMEngine) -> None:
        """Take the build-time attributes of ``engine`` (on the thread that built it)."""
        try:
            self.built = _BuildTime(engine.vllm_config, engine.renderer, engine.input_processor)
        except AttributeError:
            self.built = None  # a stand-in for LLMEngine (a test's fake engine) has none

    def wrap(self, build: Callable[[], LLMEngine]) -> Callable[[], LLMEngine]:
        """``build``, recording what it built here before returning it."""

        def build_and_record() -> LLMEngine:
            engine = build()
            self.record(engine)
            return engine

        return build_and_record


class BuildTimeAttributes:
    """The build-time properties of ``AsyncEngine``, as ``AsyncLLM``'s; see the module docstring."""

    if TYPE_CHECKING:
        _worker: Worker
        _closed: bool
        _record: BuildRecord

        @property
        def errored(self) -> bool: ...

    def _build_time(self) -> _BuildTime:
        built = self._record.built
        if built is None:
            if self._closed or self.errored:
                raise EngineClosedError()  # it never got built
            if self._worker.started:
                raise AttributeError(
                    "the wrapped engine has no vllm_config, renderer or input_processor"
                )
            raise EngineNotStartedError()
        return built

    @property
    def vllm_config(self) -> VllmConfig:
        """The engine's whole configuration, as ``AsyncLLM.vllm_config``; any thread.

        Raises ``EngineNotStartedError`` before ``start()`` has built the engine.
        """
        return self._build_time().vllm_config

    @property
    def model_config(self) -> ModelConfig:
        """The engine's model configuration, as ``AsyncLLM.model_config``; any thread."""
        return self._build_time().vllm_config.model_config

    @property
    def renderer(self) -> BaseRenderer:
        """The engine's renderer (chat templates, tokenization), as ``AsyncLLM.renderer``."""
        return self._build_time().renderer

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's input processor, as ``AsyncLLM.input_processor``; any thread."""
        return self._build_time().input_processor

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, or None with ``skip_tokenizer_init``; as ``AsyncLLM``'s."""
        return self._build_time().renderer.tokenizer

    def get_tokenizer(self) -> Any:
        """Return the engine's tokenizer (raises if it has none); sync, as ``AsyncLLM``'s."""
        return self._build_time().renderer.get_tokenizer()
