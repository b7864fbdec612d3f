"""Writing a tiny Llama checkpoint, on the calling thread: cache folder, tokenizer, weights.

Runs on the calling thread (``asynckv.testing``'s functions), and starts no
thread of its own. The architecture and tokenizer defined here are shared by
both of ``asynckv.testing``'s models; the demo model's training is in
``_training.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

__all__ = (
    "CONFIG",
    "RECIPE",
    "SEED",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_tiny",
    "cached",
    "write_configs",
)

_CORPUS = importlib.resources.files("asynckv") / "_data" / "corpus.txt"

# Bump when the build below changes in a way the config dict does not capture,
# so that stale caches are rebuilt instead of silently reused.
_RECIPE_VERSION = 1
SEED = 0
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, in this order
_UNK, _BOS, _EOS, _PAD = SPECIAL_TOKENS

# head_dim must be one the vLLM CPU attention backend supports (32, 64, ...);
# 16 is refused.  initializer_range is far above Llama's 0.02 because with
# tiny random weights that small, every prompt greedily decodes to the same
# repeated token, which makes outputs useless for telling requests apart.
CONFIG: dict[str, Any] = {
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
    "bos_token_id": SPECIAL_TOKENS.index(_BOS),
    "eos_token_id": SPECIAL_TOKENS.index(_EOS),
    "pad_token_id": SPECIAL_TOKENS.index(_PAD),
}

RECIPE: list[Any] = [_RECIPE_VERSION, SEED, VOCAB_SIZE, SPECIAL_TOKENS, CONFIG]
"""What the tiny model's cache folder is named after (with the corpus)."""


def cached(
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
    # One builder at a time: a second process asking meanwhile (two test
    # processes, two servers started together) waits and takes the first's copy,
    # rather than training the demo model a second time for minutes.
    with _locked(root / f".{target.name}.lock"):
        if target.is_dir():
            return target
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
                # Another builder got there first (one without the lock); its copy
                # is identical.
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made if missing) across processes; where
    the OS has no ``fcntl`` (Windows), no lock: builders race, and the rename keeps
    one identical copy."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_tiny(out: pathlib.Path, corpus: str) -> None:
    config = write_configs(out, corpus, CONFIG)
    _write_weights(out / "model.safetensors", config)


def write_configs(out: pathlib.Path, corpus: str, base: dict[str, Any]) -> dict[str, Any]:
    vocab_size = _write_tokenizer(out, corpus)
    config = {**base, "vocab_size": vocab_size}
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    return config


def _write_tokenizer(out: pathlib.Path, corpus: str) -> int:
    from tokenizers import Tokenizer, decoders, models, processors, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # Seeding all 256 byte symbols means any input is encodable without <unk>.
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    # Prepend <s> like real Llama tokenizers do, so prompts exercise a BOS token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A",
        pair=f"{_BOS} $A {_BOS} $B",
        special_tokens=[(_BOS, SPECIAL_TOKENS.index(_BOS))],
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
            "model_max_length": CONFIG["max_position_embeddings"],
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
    gen = torch.Generator().manual_seed(SEED)
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
