"""Test and demo helpers: tiny, locally built Llama checkpoints for exercising vLLM.

Tests and examples must run offline, so no model can be fetched from a hub.
Instead this module builds a deliberately tiny (about 0.5M parameter)
LlamaForCausalLM and a byte-level BPE tokenizer trained on a few KB of public
domain English shipped with the package.  The result is a normal Hugging Face
checkpoint directory that ``vllm.EngineArgs(model=str(path))`` loads on the CPU
backend.

* ``tiny_model()`` has random weights and builds in about a second.  Its text
  is gibberish, but greedy decoding depends on the prompt, which is all that
  tests of scheduling and KV-cache handling need.
* ``demo_model()`` has the same architecture, trained for a few seconds on the
  same text until it has memorised it, so its output is legible English: a
  line from the text greedily continues with the lines that follow it.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ("demo_model", "tiny_model")

_CORPUS = importlib.resources.files("asynckv") / "_data" / "corpus.txt"

# Bump when the build below changes in a way the config dict does not capture,
# so that stale caches are rebuilt instead of silently reused.
_RECIPE_VERSION = 1
_SEED = 0
_VOCAB_SIZE = 512
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, in this order
_UNK, _BOS, _EOS, _PAD = _SPECIAL_TOKENS

# head_dim must be one the vLLM CPU attention backend supports (32, 64, ...);
# 16 is refused.  initializer_range is far above Llama's 0.02 because with
# tiny random weights that small, every prompt greedily decodes to the same
# repeated token, which makes outputs useless for telling requests apart.
_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "initializer_range": 0.3,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "use_cache": True,
    # vLLM's CPU backend downcasts float32 checkpoints to bfloat16 under
    # dtype="auto" anyway, so storing bfloat16 loses nothing and halves the size.
    "torch_dtype": "bfloat16",
    "bos_token_id": _SPECIAL_TOKENS.index(_BOS),
    "eos_token_id": _SPECIAL_TOKENS.index(_EOS),
    "pad_token_id": _SPECIAL_TOKENS.index(_PAD),
}

_DEMO_RECIPE_VERSION = 1
# Llama's usual initializer_range: the demo model is trained, not random.
_DEMO_CONFIG: dict[str, Any] = {**_CONFIG, "initializer_range": 0.02}
# Each step trains on a batch of windows of the text, each one starting at the
# beginning of a line (after <s>, as prompts start), so that a line given as a
# prompt is tokenized exactly as in training.  A fixed step count, not a time
# budget, keeps the build deterministic; 300 steps take about 15 s on 2 idle cores
# and leave all but one of the text's lines reproduced by greedy decoding.
_TRAINING: dict[str, Any] = {
    "steps": 300,
    "batch_size": 16,
    "window": 128,
    "learning_rate": 0.01,
    "warmup_fraction": 0.1,
    "betas": (0.9, 0.98),
}


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
    recipe = [_RECIPE_VERSION, _SEED, _VOCAB_SIZE, _SPECIAL_TOKENS, _CONFIG]
    return _cached("tiny-llama", recipe, _build, cache_dir)


def demo_model(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return the directory of a tiny Llama trained on the bundled text, building it once.

    Same architecture, tokenizer and files as ``tiny_model()``, but the
    weights are trained, on first use, on the public domain English in
    ``asynckv/_data/corpus.txt`` (the opening of Hamlet's soliloquy, of *A Tale
    of Two Cities*, *Pride and Prejudice* and *Moby-Dick*, and the Gettysburg
    Address) until the model has memorised it.  Greedy decoding of a line of
    that text continues it with the text's next words; other prompts get
    fluent-looking fragments of it.  Training runs a fixed number of seeded
    optimisation steps on the CPU, about 15 seconds on two idle cores; it needs
    ``torch`` and ``transformers`` (both come with vLLM).

    Guarantees are those of ``tiny_model()``: cached in the same place (in a
    folder named ``demo-llama-<hash>``), safe to call concurrently, and
    deterministic: on one machine, with the same library versions, every build
    writes identical weights.  Floating-point kernels may differ across CPUs
    and thread counts, so another machine may build slightly different ones.
    """
    recipe = [_DEMO_RECIPE_VERSION, _SEED, _VOCAB_SIZE, _SPECIAL_TOKENS, _DEMO_CONFIG, _TRAINING]
    return _cached("demo-llama", recipe, _build_demo, cache_dir)


def _cached(
    name: str,
    recipe: list[Any],
    build: Callable[[pathlib.Path, str], None],
    cache_dir: str | os.PathLike[str] | None,
) -> pathlib.Path:
    corpus = _CORPUS.read_bytes()
    digest = hashlib.sha256(
        json.dumps(recipe, sort_keys=True).encode() + b"\0" + corpus
    ).hexdigest()[:12]

    if cache_dir is None:
        cache_dir = os.environ.get("ASYNCKV_CACHE_DIR") or "~/.cache/asynckv"
    root = pathlib.Path(cache_dir).expanduser().absolute()
    target = root / f"{name}-{digest}"
    if target.is_dir():
        return target

    root.mkdir(parents=True, exist_ok=True)
    # The temporary folder sits beside the target so the rename stays on one
    # filesystem and is therefore atomic.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        build(tmp, corpus.decode("utf-8"))
        # mkdtemp (and safetensors) create owner-only entries; a cache should be
        # readable like any other downloaded checkpoint.
        tmp.chmod(0o755)
        for child in tmp.iterdir():
            child.chmod(0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another builder got there first; its copy is identical.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(out: pathlib.Path, corpus: str) -> None:
    config = _write_configs(out, corpus, _CONFIG)
    _write_weights(out / "model.safetensors", config)


def _build_demo(out: pathlib.Path, corpus: str) -> None:
    import torch
    from safetensors.torch import save_file

    config = _write_configs(out, corpus, _DEMO_CONFIG)
    model = _train(out / "tokenizer.json", corpus, config)
    dtype = getattr(torch, config["torch_dtype"])
    tensors = {
        name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_configs(out: pathlib.Path, corpus: str, base: dict[str, Any]) -> dict[str, Any]:
    vocab_size = _write_tokenizer(out, corpus)
    config = {**base, "vocab_size": vocab_size}
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    return config


def _train(tokenizer_file: pathlib.Path, corpus: str, config: dict[str, Any]) -> Any:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    encoding = Tokenizer.from_file(str(tokenizer_file)).encode(corpus, add_special_tokens=False)
    line_starts = {0} | {i + 1 for i, char in enumerate(corpus[:-1]) if char == "\n"}
    starts = torch.tensor(
        [k for k, (begin, _) in enumerate(encoding.offsets) if begin in line_starts]
    )
    window: int = _TRAINING["window"]
    bos, eos, pad = (config[f"{name}_token_id"] for name in ("bos", "eos", "pad"))
    # The text ends with </s>, then padding so every window has full length.
    text = torch.tensor([*encoding.ids, eos] + [pad] * window)
    steps: int = _TRAINING["steps"]

    hf_config = {key: value for key, value in config.items() if key != "torch_dtype"}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    # fork_rng keeps the caller's global RNG untouched; HF draws its initial
    # weights from it, so it is seeded here.
    with torch.random.fork_rng(devices=[]):
        try:
            torch.manual_seed(_SEED)
            model = LlamaForCausalLM(LlamaConfig(**hf_config))
            gen = torch.Generator().manual_seed(_SEED)
            optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=_TRAINING["learning_rate"],
                betas=_TRAINING["betas"],
                weight_decay=0.0,
            )
            schedule = torch.optim.lr_scheduler.OneCycleLR(
                optimizer,
                max_lr=_TRAINING["learning_rate"],
                total_steps=steps,
                pct_start=_TRAINING["warmup_fraction"],
            )
            model.train()
            for _ in range(steps):
                picks = starts[
                    torch.randint(len(starts), (_TRAINING["batch_size"],), generator=gen)
                ]
                batch = torch.stack(
                    [torch.cat([torch.tensor([bos]), text[k : k + window]]) for k in picks.tolist()]
                )
                labels = batch.masked_fill(batch == pad, -100)
                loss = model(input_ids=batch, labels=labels).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
        finally:
            torch.use_deterministic_algorithms(deterministic)
    return model.eval()


def _write_tokenizer(out: pathlib.Path, corpus: str) -> int:
    from tokenizers import Tokenizer, decoders, models, processors, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        # Seeding all 256 byte symbols means any input is encodable without <unk>.
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    # Prepend <s> like real Llama tokenizers do, so prompts exercise a BOS token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A",
        pair=f"{_BOS} $A {_BOS} $B",
        special_tokens=[(_BOS, _SPECIAL_TOKENS.index(_BOS))],
    )
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": _BOS,
            "eos_token": _EOS,
            "unk_token": _UNK,
            "pad_token": _PAD,
            "model_max_length": _CONFIG["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        },
    )
    return tokenizer.get_vocab_size()


def _write_weights(path: pathlib.Path, config: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file

    hidden: int = config["hidden_size"]
    inter: int = config["intermediate_size"]
    vocab: int = config["vocab_size"]
    q_dim: int = config["num_attention_heads"] * config["head_dim"]
    kv_dim: int = config["num_key_value_heads"] * config["head_dim"]

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)

    dtype = getattr(torch, config["torch_dtype"])
    # A private generator keeps the weights independent of global RNG state and
    # of whatever else the calling process (or another thread) has drawn.
    gen = torch.Generator().manual_seed(_SEED)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):  # RMSNorm scales start at 1, as in HF
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            weight = torch.randn(shape, generator=gen, dtype=torch.float32)
            tensors[name] = (weight * config["initializer_range"]).to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
