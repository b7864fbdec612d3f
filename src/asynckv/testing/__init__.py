"""Test and demo helpers, on the calling thread: tiny Llama checkpoints, built locally.

Tests and examples must run offline, so no model can be fetched from a hub.
Instead this module builds a deliberately tiny (about 0.5M parameter)
LlamaForCausalLM and a byte-level BPE tokenizer trained on a few KB of public
domain English shipped with the package.  The result is a normal Hugging Face
checkpoint directory that ``vllm.EngineArgs(model=str(path))`` loads on the CPU
backend. Both functions run on the calling thread and start none of their own.

* ``tiny_model()`` has random weights and builds in about a second.  Its text
  is gibberish, but greedy decoding depends on the prompt, which is all that
  tests of scheduling and KV-cache handling need.
* ``demo_model()`` has the same architecture, trained for a few seconds on the
  same text until it has memorised it, so its output is legible English: a
  line from the text greedily continues with the lines that follow it.

Both run on the calling thread and start no thread of their own. The build
itself is private: the checkpoint's files in ``_checkpoint.py``, the demo
model's training in ``_training.py``.
"""

from __future__ import annotations

import os
import pathlib

from . import _checkpoint, _training

__all__ = ("demo_model", "tiny_model")


def tiny_model(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return the directory of a tiny random Llama checkpoint, building it once.

    The directory holds ``config.json``, ``generation_config.json``,
    ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``; it
    loads with ``vllm.EngineArgs(model=str(path))`` and with
    ``transformers.AutoTokenizer.from_pretrained(path)``.

    Guarantees:

    * Deterministic: with the same library versions, every build produces
      byte-identical files (fixed seed, sorted JSON, no timestamps).
    * Cached: the checkpoint lives under ``cache_dir``, else
      ``$ASYNCKV_CACHE_DIR``, else ``~/.cache/asynckv``, in a folder named
      after a hash of the build recipe and corpus, so a changed recipe gets a
      fresh folder and an unchanged one is returned without rebuilding.
    * Safe to call concurrently from threads and processes (e.g. pytest-xdist):
      each caller builds into a private temporary folder and atomically renames
      it into place; a caller that loses the race discards its copy.  A
      returned path is therefore always complete.
    """
    return _checkpoint.cached("tiny-llama", _checkpoint.RECIPE, _checkpoint.build_tiny, cache_dir)


def demo_model(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return the directory of a tiny Llama trained on the bundled text, building it once.

    Same architecture, tokenizer and files as ``tiny_model()``, but the
    weights are trained, on first use, on the public domain English in
    ``asynckv/_data/corpus.txt`` (the opening of Hamlet's soliloquy, of *A Tale
    of Two Cities*, *Pride and Prejudice* and *Moby-Dick*, and the Gettysburg
    Address) until the model has memorised it.  Greedy decoding of a line of
    that text continues it with the text's next words; other prompts get
    fluent-looking fragments of it.  Training runs a fixed number of seeded
    optimisation steps on the CPU, whose time depends on the cores and on
    what else runs on them: 23 minutes on a shared two-core machine under
    heavy load (load average above 20), less on idle cores. It needs
    ``torch`` and ``transformers`` (both come with vLLM).

    Guarantees are those of ``tiny_model()``: cached in the same place (in a
    folder named ``demo-llama-<hash>``), safe to call concurrently, and
    deterministic: on one machine, with the same library versions, every build
    writes identical weights.  Floating-point kernels may differ across CPUs
    and thread counts, so another machine may build slightly different ones.
    """
    return _checkpoint.cached("demo-llama", _training.RECIPE, _training.build_demo, cache_dir)
