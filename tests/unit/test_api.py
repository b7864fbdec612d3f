"""The public surface: what ``asynckv`` exports, and that each export documents itself."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import asynckv


def test_all_is_a_tuple_of_existing_names() -> None:
    """``__all__`` is a tuple and names exactly the public attributes of the package."""
    assert isinstance(asynckv.__all__, tuple)
    public = {
        name
        for name, value in vars(asynckv).items()
        # Submodules (testing, serve) appear here once imported; they are not exports.
        if not name.startswith("_") and name != "annotations" and not inspect.ismodule(value)
    }
    assert set(asynckv.__all__) == public


def test_every_public_name_has_a_docstring() -> None:
    """Every exported class, and every public method of it, has a docstring."""
    missing = []
    for name in asynckv.__all__:
        obj = getattr(asynckv, name)
        assert obj.__module__ == "asynckv"
        if not inspect.getdoc(obj):
            missing.append(name)
        for attr, member in vars(obj).items():
            if attr.startswith("_") or (not callable(member) and not isinstance(member, property)):
                continue
            if not inspect.getdoc(member):
                missing.append(f"{name}.{attr}")
    assert not missing


def test_asyncllm_names_are_present() -> None:
    """The operations AsyncLLM shares with asynckv keep AsyncLLM's names."""
    for name in (
        "generate",
        "abort",
        "reset_prefix_cache",
        "pause_generation",
        "resume_generation",
        "is_paused",
        "get_tokenizer",
        "add_lora",
        "remove_lora",
        "list_loras",
        "sleep",
        "wake_up",
        "is_sleeping",
        "collective_rpc",
        "check_health",
        "errored",
        "dead_error",
        "from_engine_args",
        "from_vllm_config",
        "shutdown",
        "add_request",
        "tokenizer",
        "get_supported_tasks",
        "pin_lora",
        "is_running",
        "is_stopped",
        "encode",
        "do_log_stats",
        "start_profile",
        "reset_mm_cache",
        "release_kv_cache_memory",
        "notify_kv_transfer_request_rejected",
    ):
        assert hasattr(asynckv.AsyncEngine, name), name


if TYPE_CHECKING:
    # mypy checks that one engine and a pool both implement the shared API.
    def _engine_is_api(engine: asynckv.AsyncEngine) -> asynckv.AsyncEngineAPI:
        return engine

    def _pool_is_api(pool: asynckv.AsyncEnginePool) -> asynckv.AsyncEngineAPI:
        return pool
