"""Shared engines for the suite: starting one costs 15-70 s, so each is started once.

The engines are started with a throwaway event loop and then used from each
test's own loop, which is itself what asynckv promises: one started engine
serves any loop.

Two async plugins share the suite: pytest-asyncio (auto mode) runs every
plain ``async def`` test on asyncio; anyio's plugin runs the tests marked
``anyio``, once per ``anyio_backend`` (asyncio and trio). A hook below keeps
pytest-asyncio's hands off the ``anyio`` tests: in auto mode it would take
them too, and run their trio case on asyncio.

Markers (applied here): ``engine`` for every test that drives a real vLLM
engine, ``gpu`` for the tests that need CUDA (tests/gpu/test_gpu.py), ``cpu_only``
for engine tests that assume this machine (set in their modules). With
``ASYNCKV_TEST_DEVICE=cuda`` (scripts/gpu/README.md) the engines are CUDA
engines and only ``engine``/``gpu`` tests that are not ``cpu_only`` run;
otherwise ``gpu`` tests are skipped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import pytest
import structlog
from hypothesis import HealthCheck, settings
from pytest_asyncio.plugin import PytestAsyncioFunction
from structlog.testing import capture_logs

from asynckv import AsyncEngine
from asynckv.testing import tiny_model
from support import ON_GPU, engine_args, start_engine

# Under pytest-xdist (scripts/test.sh runs two processes), vLLM's CPU backend would
# bind every engine's model threads to the same first core ("auto" reserves the
# rest for the frontend): each process's engines get a core of their own instead.
# Tests that bind cores themselves (test_tp, test_multinode) set their own.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw") and hasattr(os, "sched_getaffinity"):
    _CORES = sorted(os.sched_getaffinity(0))
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND", str(_CORES[int(_XDIST_WORKER[2:]) % len(_CORES)])
    )

# Importing hypothesis runs its plugins, among them trio's, which registers a PRNG and
# checks with gc.get_referrers that something holds it. After an engine has frozen the
# GC heap (freeze_gc) that check sees nothing and warns, which the suite makes an error:
# imported here, at startup, it runs before any freeze. (The GPU machine may lack it.)
with contextlib.suppress(ImportError):
    import hypothesis  # noqa: F401
# -- hypothesis profiles for the model-based tests (tests/model/) ----------------
#
# "ci" (the default) is reproducible: derandomized, no example database, so a
# run explores the same examples every time. "long" is a local soak run:
# random, with the database, many more and longer examples. Select it with
# HYPOTHESIS_PROFILE=long (docs/reliability.md). The "-engine" variants size
# the machine over a real engine, whose steps are far slower.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    max_examples=500,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "ci-engine",
    max_examples=50,
    stateful_step_count=15,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "long",
    max_examples=20_000,
    stateful_step_count=80,
    deadline=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "long-engine",
    max_examples=1_000,
    stateful_step_count=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The tiny Llama checkpoint, built once and cached on disk."""
    return tiny_model()


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[AsyncEngine]:
    """A started engine in vLLM's default multiprocess mode, shared by the suite.

    Eager, as every engine the suite builds (``engine_args``); the compiled
    path, vLLM's default, runs in the examples' tests (tests/engine/test_example.py).
    """
    started = start_engine(engine_args(model_path))
    yield started
    started.shutdown()


@pytest.fixture(scope="session")
def inproc_engine(model_path: Path) -> Iterator[AsyncEngine]:
    """An in-process engine (no engine-core process), built by hand and wrapped.

    Built from the same arguments as ``engine``, whose greedy tokens it is compared with.
    """
    from vllm import LLMEngine
    from vllm.v1.executor import Executor

    config = engine_args(model_path).create_engine_config()
    llm_engine = LLMEngine(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
        multiprocess_mode=False,
    )
    wrapped = AsyncEngine(llm_engine)
    yield wrapped
    wrapped.shutdown()


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Capture structlog events; restore structlog's defaults afterwards."""
    with capture_logs() as captured:
        yield captured
    structlog.reset_defaults()


# -- the reliability suite: each test reports its figures at the end of the run --

_FIGURES: list[str] = []


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record one line of figures for this test, printed at the end of the run.

    Kept in the test's report (``user_properties``), which pytest-xdist sends
    from the process that ran the test to the one that prints the summary.
    """

    def record(line: str) -> None:
        request.node.user_properties.append(("figures", f"{request.node.name}: {line}"))

    return record


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The teardown report carries every figure the test recorded, its fixtures' included.
    if report.when == "teardown":
        _FIGURES.extend(str(value) for key, value in report.user_properties if key == "figures")


# A test that takes one of these fixtures drives a real engine.
_ENGINE_FIXTURES = {"engine", "inproc_engine", "model_path", "demo_engine", "gpu_engine"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "reliability" in item.nodeid:
            item.add_marker(pytest.mark.reliability)
        if _ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
    if ON_GPU:
        # Only the tests that are about the engine: the rest need no GPU.
        kept = [
            item
            for item in items
            if (item.get_closest_marker("engine") or item.get_closest_marker("gpu"))
            and not item.get_closest_marker("cpu_only")
        ]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    else:
        skip = pytest.mark.skip(reason="needs CUDA: ASYNCKV_TEST_DEVICE=cuda on a GPU machine")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


# -- asyncio and trio: the tests marked `anyio` ------------------------------------


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The backends every `anyio`-marked test runs on (named, so a missing trio fails)."""
    backend: str = request.param
    return backend


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Any:
    """Hand the `anyio`-marked coroutine tests back from pytest-asyncio to anyio's plugin.

    pytest-asyncio's auto mode turns every coroutine test into its own item,
    which runs the test on an asyncio runner whatever ``anyio_backend`` says.
    This wrapper runs after it and rebuilds those items as plain ones (as
    anyio's plugin builds its own), without the ``asyncio`` marker it added.
    """
    result = yield
    if not isinstance(result, list):
        return result
    kept: list[Any] = []
    for item in result:
        if isinstance(item, PytestAsyncioFunction) and item.get_closest_marker("anyio"):
            plain = pytest.Function.from_parent(
                item.parent,
                name=item.name,
                callspec=getattr(item, "callspec", None),
                callobj=item.obj,
                fixtureinfo=item._fixtureinfo,
                keywords={k: v for k, v in item.keywords.items() if k != "asyncio"},
                originalname=item.originalname,
            )
            plain.own_markers = [m for m in item.own_markers if m.name != "asyncio"]
            item = plain
        kept.append(item)
    return kept
