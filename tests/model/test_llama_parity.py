"""kvfence's Llama-family decoder on paged KV matches HF transformers within float32 tolerance."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from kvmodel_helpers import hf_logits, make_pool, new_seq, step, step_many

from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.tiny import make_tiny_checkpoint

TOL = 1e-4


def _hf(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _greedy_parity(
    model: LlamaModel, hf: torch.nn.Module, lengths: list[int], steps: int, vocab: int
) -> float:
    """Batched prefill then `steps` batched decode steps; the worst |kvfence - HF| over all logits."""
    pool = make_pool(model.config, 64)
    seqs = [new_seq(pool, p, len(p) + steps + 1) for p in _prompts(lengths, vocab)]
    worst = 0.0
    out = step(model, pool, [(s, len(s.tokens)) for s in seqs], all_logits=True)
    offset = 0
    for s in seqs:
        n = len(s.tokens)
        worst = max(worst, float((out[offset : offset + n] - hf_logits(hf, s.tokens)).abs().max()))
        s.tokens.append(int(out[offset + n - 1].argmax()))
        offset += n
    for _ in range(steps):
        out = step(model, pool, [(s, 1) for s in seqs])
        for i, s in enumerate(seqs):
            s.generated += 1
            ref = hf_logits(hf, s.tokens)[-1]
            worst = max(worst, float((out[i] - ref).abs().max()))
            s.tokens.append(int(out[i].argmax()))
    pool.check_integrity([h for s in seqs for h in s.pages])
    return worst


def test_tiny_checkpoint_prefill_and_decode_match_transformers(tiny_checkpoint: Path) -> None:
    loaded = load_model(tiny_checkpoint)
    assert isinstance(loaded.model, LlamaModel)
    worst = _greedy_parity(loaded.model, _hf(tiny_checkpoint), [5, 37, 16, 1], 16, 512)
    assert worst <= TOL


def test_chunked_prefill_mixed_with_decode_matches_transformers(tiny_checkpoint: Path) -> None:
    """A long prompt in chunks of 13 (crossing pages), in the same steps as another row's decode."""
    loaded = load_model(tiny_checkpoint)
    model, hf = loaded.model, _hf(tiny_checkpoint)
    pool = make_pool(loaded.config, 64)
    long_seq, short = (new_seq(pool, p, 80) for p in _prompts([50, 7], 512, seed=3))
    out = step(model, pool, [(short, 7)])
    short.tokens.append(int(out[0].argmax()))
    chunk_logits = []
    while long_seq.cached < len(long_seq.tokens):
        n = min(13, len(long_seq.tokens) - long_seq.cached)
        out = step(model, pool, [(short, 1), (long_seq, n)], all_logits=True)
        short.generated += 1
        ref = hf_logits(hf, short.tokens)[-1]
        assert float((out[0] - ref).abs().max()) <= TOL
        short.tokens.append(int(out[0].argmax()))
        chunk_logits.append(out[1:])
    ref_long = hf_logits(hf, long_seq.tokens)
    assert float((torch.cat(chunk_logits) - ref_long).abs().max()) <= TOL


def test_one_forward_over_two_pools_matches_transformers(tiny_checkpoint: Path) -> None:
    """Prefill's chunks (one pool) and decode's rows (another) in one forward: HF parity per row."""
    loaded = load_model(tiny_checkpoint)
    model, hf = loaded.model, _hf(tiny_checkpoint)
    prefill_pool, decode_pool = make_pool(loaded.config, 32), make_pool(loaded.config, 32)
    long_seq, other = (new_seq(prefill_pool, p, 80) for p in _prompts([50, 21], 512, seed=4))
    decoding = [new_seq(decode_pool, p, 40) for p in _prompts([9, 17, 3], 512, seed=5)]
    for s in decoding:
        out = step(model, decode_pool, [(s, len(s.tokens))])
        s.tokens.append(int(out[0].argmax()))
    chunk_logits: list[torch.Tensor] = []
    while long_seq.cached < len(long_seq.tokens):
        n = min(13, len(long_seq.tokens) - long_seq.cached)
        prefill_rows = [(long_seq, n)] + ([(other, 21)] if other.cached == 0 else [])
        p_out, d_out = step_many(
            model,
            [(prefill_pool, prefill_rows, True), (decode_pool, [(s, 1) for s in decoding], False)],
        )
        chunk_logits.append(p_out[:n])
        for i, s in enumerate(decoding):
            s.generated += 1
            assert float((d_out[i] - hf_logits(hf, s.tokens)[-1]).abs().max()) <= TOL
            s.tokens.append(int(d_out[i].argmax()))
        if p_out.shape[0] > n:
            assert float((p_out[n:] - hf_logits(hf, other.tokens)).abs().max()) <= TOL
    assert float((torch.cat(chunk_logits) - hf_logits(hf, long_seq.tokens)).abs().max()) <= TOL
    prefill_pool.check_integrity([h for s in (long_seq, other) for h in s.pages])
    decode_pool.check_integrity([h for s in decoding for h in s.pages])


def test_parity_check_can_fail(tiny_checkpoint: Path) -> None:
    """Negative control: shifting every position by one breaks parity by far more than TOL."""
    loaded = load_model(tiny_checkpoint)
    model = loaded.model
    assert isinstance(model, LlamaModel)
    prompt = _prompts([24], 512, seed=5)[0]
    pool = make_pool(loaded.config, 8)
    s = new_seq(pool, prompt, 32)
    out = step(model, pool, [(s, 24)], all_logits=True)
    ref = hf_logits(_hf(tiny_checkpoint), prompt)
    assert float((out - ref).abs().max()) <= TOL
    model.inv_freq.mul_(1.5)  # a RoPE bug
    s2 = new_seq(pool, prompt, 32)
    bad = step(model, pool, [(s2, 24)], all_logits=True)
    assert float((bad - ref).abs().max()) > 100 * TOL


def _random_hf_checkpoint(
    tmp_path: Path, tiny_checkpoint: Path, config: Any, model_cls: Any
) -> Path:
    """A small random HF model saved with the tiny tokenizer; weights peaked enough to matter."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.05 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    out = tmp_path / config.model_type
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tiny_checkpoint / f).read_bytes())
    return out


COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("qwen2", transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1e6)),
        # A window smaller than the sequences, so the sliding mask is exercised.
        ("mistral", transformers.MistralConfig(**COMMON, sliding_window=8, head_dim=48)),
        (
            "llama3-rope",
            transformers.LlamaConfig(
                **COMMON,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            ),
        ),
        (
            "linear-rope",
            transformers.LlamaConfig(
                **COMMON, rope_scaling={"rope_type": "linear", "factor": 4.0}, attention_bias=True
            ),
        ),
    ],
)
def test_config_variants_match_transformers(
    name: str, config: Any, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    cls = transformers.AutoModelForCausalLM.from_config(config).__class__
    directory = _random_hf_checkpoint(tmp_path, tiny_checkpoint, config, cls)
    loaded = load_model(directory)
    assert isinstance(loaded.model, LlamaModel)
    worst = _greedy_parity(loaded.model, _hf(directory), [21, 6, 12], 16, 512)
    assert worst <= TOL, name


def test_smollm_preset_geometry(tmp_path: Path) -> None:
    """The benchmark preset has SmolLM2-135M's geometry (checked on the config, not the weights)."""
    from kvfence.model.config import ModelConfig
    from kvfence.model.tiny import PRESETS

    p = PRESETS["smollm"]
    assert (p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.vocab_size) == (
        576,
        30,
        9,
        3,
        49152,
    )
    assert p.hidden_size // p.num_heads == 64 and p.tie_word_embeddings
    tiny = make_tiny_checkpoint(tmp_path / "t", seed=1)
    assert ModelConfig.from_file(tiny / "config.json").head_dim >= 32
