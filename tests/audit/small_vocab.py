"""A tiny checkpoint with a 382-token vocabulary, smaller than the probes' default id range.

The tiny preset's checkpoint with its tokenizer retrained to 382 ids and the embedding and
output rows cut to match: a kvfence server on it refuses token ids of 382 and above (400).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from kvfence.model.tiny import build_tokenizer, make_tiny_checkpoint

VOCAB = 382
ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def small_vocab_checkpoint(out: Path, vocab: int = VOCAB) -> Path:
    make_tiny_checkpoint(out, preset="tiny")
    tokenizer = build_tokenizer(vocab)
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= vocab
    tok_json = json.loads(tokenizer.to_str())
    (out / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False), encoding="utf-8")
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(out / "model.safetensors"))
    for name in ROWS:
        if name in weights:
            weights[name] = weights[name][:vocab].contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
