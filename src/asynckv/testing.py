"""Test helpers: a tiny, locally built Llama checkpoint for exercising vLLM.

Tests must run offline, so no model can be fetched from a hub.  Instead this
module builds a deliberately tiny (about 0.5M parameter) LlamaForCausalLM with
random weights and a byte-level BPE tokenizer trained on a few KB of public
domain English shipped with the package.  The result is a normal Hugging Face
checkpoint directory that ``vllm.EngineArgs(model=str(path))`` loads on the CPU
backend; building it takes about a second.  Its text is gibberish, but greedy
decoding depends on the prompt, which is all that tests of scheduling and
KV-cache handling need.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

__all__ = ("tiny_model",)

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
    corpus = _CORPUS.read_bytes()
    recipe = json.dumps(
        [_RECIPE_VERSION, _SEED, _VOCAB_SIZE, _SPECIAL_TOKENS, _CONFIG], sort_keys=True
    ).encode()
    digest = hashlib.sha256(recipe + b"\0" + corpus).hexdigest()[:12]

    if cache_dir is None:
        cache_dir = os.environ.get("ASYNCKV_CACHE_DIR") or "~/.cache/asynckv"
    root = pathlib.Path(cache_dir).expanduser().absolute()
    target = root / f"tiny-llama-{digest}"
    if target.is_dir():
        return target

    root.mkdir(parents=True, exist_ok=True)
    # The temporary folder sits beside the target so the rename stays on one
    # filesystem and is therefore atomic.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        _build(tmp, corpus.decode("utf-8"))
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
    vocab_size = _write_tokenizer(out, corpus)
    config = {**_CONFIG, "vocab_size": vocab_size}
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    _write_weights(out / "model.safetensors", config)


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
