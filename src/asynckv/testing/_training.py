"""Training the demo model, on the calling thread: the tiny Llama memorises the bundled text.

Runs on the calling thread (``asynckv.testing.demo_model``), and starts no
thread of its own (torch may use its own intra-op threads). The checkpoint's
files other than the weights are written by ``_checkpoint.py``.
"""

from __future__ import annotations

import pathlib
from typing import Any

from ._checkpoint import CONFIG, SEED, SPECIAL_TOKENS, VOCAB_SIZE, write_configs

__all__ = ("RECIPE", "build_demo")

_DEMO_RECIPE_VERSION = 1
# Llama's usual initializer_range: the demo model is trained, not random.
_DEMO_CONFIG: dict[str, Any] = {**CONFIG, "initializer_range": 0.02}
# Each step trains on a batch of windows of the text, each one starting at the
# beginning of a line (after <s>, as prompts start), so that a line given as a
# prompt is tokenized exactly as in training.  A fixed step count, not a time
# budget, keeps the build deterministic; 300 steps (23 min on a heavily loaded shared
# two-core machine, less on idle cores) leave all but one of the text's lines
# reproduced by greedy decoding.
_TRAINING: dict[str, Any] = {
    "steps": 300,
    "batch_size": 16,
    "window": 128,
    "learning_rate": 0.01,
    "warmup_fraction": 0.1,
    "betas": (0.9, 0.98),
}

RECIPE: list[Any] = [
    _DEMO_RECIPE_VERSION,
    SEED,
    VOCAB_SIZE,
    SPECIAL_TOKENS,
    _DEMO_CONFIG,
    _TRAINING,
]
"""What the demo model's cache folder is named after (with the corpus)."""


def build_demo(out: pathlib.Path, corpus: str) -> None:
    import torch
    from safetensors.torch import save_file

    config = write_configs(out, corpus, _DEMO_CONFIG)
    model = _train(out / "tokenizer.json", corpus, config)
    dtype = getattr(torch, config["torch_dtype"])
    tensors = {
        name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


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
            torch.manual_seed(SEED)
            model = LlamaForCausalLM(LlamaConfig(**hf_config))
            gen = torch.Generator().manual_seed(SEED)
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
