"""Build, offline, a tokenizer with the 8B-shaped model's vocabulary, as the tiny model gets one.

The 8B-shaped checkpoint (scripts/gpu/llama8b) has no tokenizer, and a server
needs one (it tokenizes prompts and detokenizes outputs, and vLLM's benchmark
client makes its random prompts with it). Nothing can be downloaded on the
device, so this builds one with Llama 3's layout: 128,000 ordinary tokens,
then ``<|begin_of_text|>`` (128000), ``<|end_of_text|>`` (128001) and
reserved special tokens up to the config's ``vocab_size``, so every id the
model can sample decodes.

The ordinary tokens are a byte-level BPE trained on asynckv's bundled text,
exactly as ``asynckv.testing`` trains the tiny model's (byte alphabet, no
unknown token); a few KB of text yields only some thousand merges, so the
rest are made: each a merge of a trained token with a byte, in a fixed order.
Deterministic, in a few seconds. Usage (from the repository root)::

    python3 scripts/gpu/tokenizer.py scripts/gpu/llama8b /tmp/llama8b

copies ``config.json`` to the output folder and writes the tokenizer beside it.
Nothing here imports vLLM or asynckv: only ``tokenizers`` (and the bundled text).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BEGIN, END = "<|begin_of_text|>", "<|end_of_text|>"
# asynckv's bundled text, read from the tree: importing asynckv would import all of vLLM.
CORPUS = Path(__file__).resolve().parents[2] / "src" / "asynckv" / "_data" / "corpus.txt"


def build(config_dir: Path, out: Path) -> int:
    """Write ``out/`` (config.json, tokenizer files); return the tokenizer's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    config = json.loads((config_dir / "config.json").read_text())
    vocab_size, bos, eos = config["vocab_size"], config["bos_token_id"], config["eos_token_id"]
    ordinary = min(bos, eos)  # the ids below the first special token
    corpus = CORPUS.read_text("utf-8")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=ordinary, initial_alphabet=ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)

    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[object] = data["model"]["merges"]
    as_text = bool(merges) and isinstance(merges[0], str)  # older tokenizers: "a b"
    trained = sorted(vocab, key=vocab.__getitem__)
    alphabet = sorted(ByteLevel.alphabet())
    for first in trained:
        for byte in alphabet:
            if len(vocab) >= ordinary:
                break
            token = first + byte
            if token not in vocab:
                vocab[token] = len(vocab)
                merges.append(f"{first} {byte}" if as_text else [first, byte])
    assert len(vocab) == ordinary, len(vocab)

    names = {bos: BEGIN, eos: END}
    data["added_tokens"] = [
        {
            "id": i,
            "content": names.get(i, f"<|reserved_special_token_{i - ordinary}|>"),
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(ordinary, vocab_size)
    ]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": BEGIN, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": BEGIN, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {BEGIN: {"id": BEGIN, "ids": [bos], "tokens": [BEGIN]}},
    }
    out.mkdir(parents=True, exist_ok=True)
    # With no transformers_version, transformers takes a local checkpoint for a Mistral
    # one and warns about its tokenizer's regex; say which (any) version wrote it.
    config.setdefault("transformers_version", "4.57.0")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN,
        "eos_token": END,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    built = Tokenizer.from_file(str(out / "tokenizer.json"))
    line = corpus.splitlines()[0]
    assert built.decode(built.encode(line).ids, skip_special_tokens=True) == line
    size: int = built.get_vocab_size()
    assert size == vocab_size, (size, vocab_size)
    return size


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python3 scripts/gpu/tokenizer.py CONFIG_DIR OUT_DIR")
    print(f"tokenizer of {build(Path(sys.argv[1]), Path(sys.argv[2]))} tokens in {sys.argv[2]}")
