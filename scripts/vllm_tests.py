"""Run vLLM's own tests on vLLM and on asynckv, and print the comparison.

Usage (from the repository root, with .venv set up)::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python scripts/vllm_tests.py --vllm-tests PATH \
        [--suite engine,openai] [--backends vllm,asynckv] [-k EXPR]

``PATH`` is the ``tests`` folder of vLLM's source at the installed version
(v0.32.0: the ``tests`` folder of its sdist, ``pip download --no-deps
--no-binary :all: vllm==0.32.0``, or of ``git clone -b v0.32.0
https://github.com/vllm-project/vllm``); the tests are vLLM's and are not
copied into this project. Each suite's files are copied into a scratch folder,
with the edits that let them run here (below), next to a conftest of ours;
then pytest runs them once per backend, each in a process of its own, and the
outcomes are printed side by side. Issue 30 has the why. CI never runs this
(testpaths is tests/).

Two suites:

* ``engine``: vLLM's ``AsyncLLM`` tests (``tests/v1/engine``) on vLLM's
  ``AsyncLLM`` (backend ``vllm``) and on asynckv's ``AsyncEngine``:
  scripts/vllm_tests/conftest.py gives them asynckv's engine where they build
  an ``AsyncLLM``. About 25 minutes on two cores.
* ``openai``: vLLM's OpenAI-server tests (``FILES["openai"]``) against
  ``python -m vllm.entrypoints.openai.api_server`` (backend ``vllm``) and
  ``python -m asynckv.serve``: scripts/vllm_tests/openai/conftest.py swaps the
  command vLLM's ``tests/utils.py`` ``RemoteOpenAIServer`` starts (``vllm
  serve``). Every module starts its own servers (about 17 per backend); the
  whole suite was not timed. On idle two cores: the three unit-test modules
  (no server, 82 tests) take 2.5 minutes for both backends, test_chat_echo.py
  (one server, 4 tests) 2 minutes on vllm serve and 1.4 on asynckv.serve.

The engine suite's edits, each because this machine can't run the test as written:

* the model: vLLM's ``meta-llama/Llama-3.2-1B-Instruct`` becomes asynckv's tiny
  model (``asynckv.testing.tiny_model()``, built offline), ``max_model_len=512``;
* the token counts beyond that context (50,000, 3,000 and 1,000) become 400;
* the module-level CUDA skip goes (vLLM's CPU build runs them);
* ``@pytest.mark.asyncio(scope="module")`` becomes the run's one loop, so the
  engines shared by the conftest serve every test (an ``AsyncLLM`` is bound
  to the loop of its first request);
* the vision cases are deselected and their image never loaded: no vision
  model or image asset can be had offline;
* two modules vLLM moved since (or before) the tests' version are imported
  from where 0.32 has them.

The openai suite's edits (``_OPENAI_EDITS``), likewise:

* every model (Qwen3-0.6B, opt-125m, gpt2, zephyr-7b-beta, Qwen2-1.5B-Instruct,
  tiny-random-Llama) becomes the tiny model, by path (no hub offline); the unit
  tests' mocked model configs load its tokenizer;
* ``--max-model-len`` above the tiny model's 2048 becomes 2048, and
  test_basic.py's 10,000-token requests 2,000 (so they are admitted and time
  out on the client, as the test means, rather than being refused);
* test_token_in_token_out.py serves the tiny model's folder instead of
  downloading Qwen3's config;
* test_chat.py's LoRA adapter (zephyr-7b-beta-lora, a download) goes, with its
  flags; its ``zephyr-lora`` cases are deselected;
* every server gets asynckv's chat template, the tiny model having none (the
  conftest adds it, the same on both backends).

What cannot run here at all is printed at the end (``CANNOT_RUN``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BACKENDS = ("vllm", "asynckv")
SUITES = ("engine", "openai")
FILES = {
    "engine": ("v1/engine/test_async_llm.py", "v1/engine/test_abort_final_step.py"),
    # Issue 30's list, where v0.32.0 keeps them (basic and shutdown moved out of openai/).
    "openai": (
        "entrypoints/serve/instrumentator/test_basic.py",
        "entrypoints/openai/completion/test_completion.py",
        "entrypoints/openai/completion/test_completion_error.py",
        "entrypoints/openai/completion/test_prompt_validation.py",
        "entrypoints/openai/completion/test_token_in_token_out.py",
        "entrypoints/openai/chat_completion/test_chat.py",
        "entrypoints/openai/chat_completion/test_chat_error.py",
        "entrypoints/openai/chat_completion/test_chat_echo.py",
        "entrypoints/openai/chat_completion/test_non_object_body_validation.py",
        "entrypoints/launchers/test_shutdown.py",
    ),
}
# What each suite leaves out (pytest -k), listed in CANNOT_RUN.
DESELECT = {"engine": "not engine_args1", "openai": "not zephyr-lora"}
LABELS = {"engine": ("AsyncLLM", "asynckv"), "openai": ("vllm serve", "asynckv.serve")}

# What vLLM's tests ask for that this machine (two CPU cores, no network) can't give.
CANNOT_RUN = {
    "test_async_llm.py vision cases (engine_args1: test_load x2, test_abort x2, "
    "test_finished_flag x2, test_mid_stream_cancellation)": (
        "Qwen/Qwen2-VL-2B-Instruct and the stop-sign image need the network"
    ),
    "test_abort_final_step.py (both cases)": (
        "vLLM's CPU backend spawns the engine core, so the test's patch of execute_model and "
        "its KV connector, registered in the test's process, never reach it (the test says "
        "so: 'spawn was used instead of fork'); the engine core fails to start on both"
    ),
    "test_chat.py zephyr-lora cases": (
        "the LoRA adapter (typeof/zephyr-7b-beta-lora) needs the network, and it fits "
        "zephyr-7b-beta, not the tiny model"
    ),
}

_EDITS: tuple[tuple[str, str], ...] = (
    # Modules that moved between the tests' vLLM and 0.32: the names are the same.
    (r"vllm\.entrypoints\.openai\.engine\.protocol", "vllm.entrypoints.serve.engine.protocol"),
    (
        r"from vllm\.entrypoints\.openai\.serving_models import BaseModelPath, OpenAIServingModels",
        "from vllm.entrypoints.openai.models.protocol import BaseModelPath\n"
        "from vllm.entrypoints.openai.models.serving import OpenAIServingModels",
    ),
    (r"if not current_platform\.is_cuda\(\):", "if False:"),
    (r"@pytest\.mark\.asyncio\(scope=\"module\"\)", "@pytest.mark.asyncio"),
    (r"ImageAsset\(\"stop_sign\"\)\.pil_image", "None"),
    (r"\b(50000|3000|1000)\b", "400"),
)


# The models vLLM's OpenAI-server tests name (all need the hub).
_OPENAI_MODELS = (
    "Qwen/Qwen3-0.6B",
    "facebook/opt-125m",
    "openai-community/gpt2",
    "HuggingFaceH4/zephyr-7b-beta",
    "Qwen/Qwen2-1.5B-Instruct",
    "hmellor/tiny-random-LlamaForCausalLM",
)
_TINY_CONTEXT = 2048  # the tiny model's max_position_embeddings

_OPENAI_EDITS: tuple[tuple[str, str], ...] = (
    # test_basic.py: requests the 2048-token context admits.
    (r"max_tokens=10000", "max_tokens=2000"),
    (r'"min_tokens": 10000', '"min_tokens": 2000'),
    # test_token_in_token_out.py: the tiny model's folder, not a download of Qwen3's.
    (r"MODEL_PATH = download_weights_from_hf\([^)]*\)", "MODEL_PATH = MODEL_NAME"),
    # test_chat.py: no LoRA adapter.
    (
        r'return hf_api\(\)\.snapshot_download\(repo_id="typeof/zephyr-7b-beta-lora"\)',
        "return None",
    ),
    (r'\s*"--enable-lora",\s*"--lora-modules",\s*f"zephyr-lora=\{zephyr_lora_files\}",', ""),
    (r'\s*"--max-lora-rank",\s*"64",\s*"--max-cpu-loras",\s*"2",', ""),
)


def _cap_context(match: re.Match[str]) -> str:
    return f"{match[1]}{min(int(match[2]), _TINY_CONTEXT)}{match[3]}"


def prepare_openai(vllm_tests: Path, work: Path, model: str) -> list[Path]:
    """Copy vLLM's OpenAI-server tests and ``tests/utils.py`` into ``work/tests``, edited."""
    shutil.copy(HERE / "vllm_tests" / "openai" / "conftest.py", work / "conftest.py")
    shutil.copy(HERE / "vllm_tests" / "openai" / "pytest.ini", work / "pytest.ini")
    root = work / "tests"
    # The packages on the way (tests.utils is imported by name), vLLM's utils and the
    # light conftest of tests/entrypoints (its sample schemas); not tests/conftest.py,
    # which needs packages vLLM's test requirements add (tblib) and GPU runners.
    for name in ("__init__.py", "utils.py", "entrypoints/conftest.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(vllm_tests / name, root / name)
    copied = []
    for name in FILES["openai"]:
        source = vllm_tests / name
        for folder in Path(name).parents:
            if (vllm_tests / folder / "__init__.py").exists():
                (root / folder).mkdir(parents=True, exist_ok=True)
                shutil.copy(vllm_tests / folder / "__init__.py", root / folder / "__init__.py")
        text = source.read_text()
        for original in _OPENAI_MODELS:
            text = text.replace(f'"{original}"', repr(model))
        text = re.sub(r'("--max-model-len",\s*")(\d+)(")', _cap_context, text)
        for pattern, replacement in _OPENAI_EDITS:
            text = re.sub(pattern, replacement, text)
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        copied.append(target)
    return copied


def prepare(vllm_tests: Path, work: Path, model: str) -> list[Path]:
    """Copy vLLM's AsyncLLM test files into ``work`` with the edits, beside the conftest."""
    shutil.copy(HERE / "vllm_tests" / "conftest.py", work / "conftest.py")
    shutil.copy(HERE / "vllm_tests" / "pytest.ini", work / "pytest.ini")
    copied = []
    for name in FILES["engine"]:
        text = (vllm_tests / name).read_text()
        text = text.replace(
            'model="meta-llama/Llama-3.2-1B-Instruct"',
            f"model={model!r}, max_model_len=512, max_num_seqs=128",
        )
        for pattern, replacement in _EDITS:
            text = re.sub(pattern, replacement, text)
        target = work / Path(name).name
        target.write_text(text)
        copied.append(target)
    return copied


def run(
    suite: str, backend: str, files: list[Path], work: Path, keyword: str | None
) -> dict[str, str]:
    """Run the copied tests of one suite on one backend; each test id's outcome."""
    report = work / f"{backend}.xml"
    # The engine suite's conftest names vLLM's side after its engine.
    named = "asyncllm" if suite == "engine" and backend == "vllm" else backend
    env = dict(os.environ, VLLM_TESTS_BACKEND=named)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # This checkout's asynckv, in the servers too.
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(work / "pytest.ini"),
        "--rootdir",
        str(work),
        "-p",
        "no:cacheprovider",
        "-q",
        "-k",
        DESELECT[suite] + (f" and ({keyword})" if keyword else ""),
        f"--junitxml={report}",
        *map(str, files),
    ]
    print(f"== {suite} on {backend}: {' '.join(command[3:])}", flush=True)
    subprocess.run(command, cwd=work, env=env, check=False)
    outcomes: dict[str, str] = {}
    if not report.exists():
        return outcomes
    for case in ET.parse(report).getroot().iter("testcase"):
        # The module from its name on (and a test class after it): test_x.TestY::test_z.
        parts = case.get("classname", "").split(".")
        first = max((i for i, part in enumerate(parts) if part.startswith("test_")), default=0)
        name = f"{'.'.join(parts[first:])}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                first_line = next(iter((child.get("message") or "").splitlines()), "")
                outcome = f"{child.tag}: {first_line[:90]}"
            elif child.tag == "skipped":
                outcome = "skipped"
        outcomes[name] = outcome
    return outcomes


def compare(suite: str, results: dict[str, dict[str, str]]) -> None:
    """Print one suite's outcomes side by side, the counts, and the tests that differ."""
    labels = dict(zip(BACKENDS, LABELS[suite], strict=True))
    names = sorted({name for outcomes in results.values() for name in outcomes})
    width = max((len(n) for n in names), default=10)
    print(f"\n== {suite}\n" + "test".ljust(width), *(labels[b].ljust(13) for b in results))
    for name in names:
        print(name.ljust(width), *(results[b].get(name, "-")[:13].ljust(13) for b in results))
    print()
    for backend, outcomes in results.items():
        counts = {
            kind: sum(1 for o in outcomes.values() if o.split(":")[0] == kind)
            for kind in ("passed", "failure", "error", "skipped")
        }
        print(
            f"{labels[backend]}: {counts['passed']} of {len(outcomes)} passed, "
            f"{counts['failure']} failed, {counts['error']} errors, {counts['skipped']} skipped"
        )
    differ = [n for n in names if len({results[b].get(n) for b in results}) > 1]
    print(f"\n{len(differ)} differ:")
    for name in differ:
        for backend in results:
            print(f"  {name} [{labels[backend]}] {results[backend].get(name, '-')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vllm-tests", type=Path, required=True, help="vLLM's tests folder")
    parser.add_argument("--suite", default=",".join(SUITES), help="engine, openai or both")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="vllm, asynckv or both")
    parser.add_argument("-k", dest="keyword", default=None, help="only tests matching this")
    options = parser.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from asynckv.testing import tiny_model

    model = str(tiny_model())
    prepares = {"engine": prepare, "openai": prepare_openai}
    for suite in options.suite.split(","):
        results: dict[str, dict[str, str]] = {}
        with tempfile.TemporaryDirectory(prefix=f"asynckv-vllm-{suite}-") as scratch:
            work = Path(scratch)
            files = prepares[suite](options.vllm_tests, work, model)
            for backend in options.backends.split(","):
                results[backend] = run(suite, backend, files, work, options.keyword)
        compare(suite, results)
    print("\nCannot run here:")
    for what, why in CANNOT_RUN.items():
        print(f"  {what}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
