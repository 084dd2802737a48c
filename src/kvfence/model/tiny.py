"""Deterministic random-weight checkpoints in exactly the Hugging Face layout.

`make_tiny_checkpoint(dir, seed=...)` writes `config.json` (LlamaForCausalLM),
`model.safetensors`, `tokenizer.json` (byte-level BPE with the GPT-2
pre-tokenizer regex), `tokenizer_config.json` (with a ChatML chat template),
`special_tokens_map.json` and `generation_config.json`. The same seed gives
byte-identical files; nothing is downloaded. The files are readable by
`transformers>=5`, vLLM and llama.cpp's converter (see PEERS.md).

The tokenizer has the 256 byte tokens, so any text (canary strings included)
round-trips exactly, plus merges learned deterministically from a fixed
built-in corpus and three special tokens.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    import torch

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A fixed corpus for the merges: English prose, code, numbers and a little non-ASCII.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A tenant sends a request to the server and the
server answers with the tokens of the model. Each request owns the pages of its key and value
cache, and no other request may read them. The ledger records the owner and the generation of
every page; a release invalidates the page before anyone else can allocate it again.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
The answer is 42. There are 3 apples and 7 oranges in the basket, 10 fruits in all.
def forward(self, batch, pool):
    pool.verify(batch.pages)
    for layer in self.layers:
        hidden = layer(hidden, batch, pool)
    return self.lm_head(self.norm(hidden))
import torch
from dataclasses import dataclass
class Request:
    def __init__(self, prompt: str, max_tokens: int = 16) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
{"model": "kvfence", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.0}
Once upon a time there was a little engine that served many tenants at once. It kept their
secrets in separate pages and never mixed them up, because every read was checked against the
ledger. The user asked the assistant a question, and the assistant gave a helpful answer.
<|im_start|>user
Write a short poem about the sea.<|im_end|>
<|im_start|>assistant
The sea is wide, the sea is deep, the waves will rock the world to sleep.<|im_end|>
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2026 3.14159 -1 +1 1e-4
Café, naïve, über, señor, 東京, привет, 😀 — “quotes” and ‘apostrophes’.
""".strip()


@dataclass(frozen=True, slots=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    tokenizer_size: int
    init_std: float


PRESETS: dict[str, Preset] = {
    # Head dim 32: the smallest vLLM's CPU attention accepts (PEERS.md). A peaked
    # init (std 0.1) makes attention far from uniform, so parity tests see positions.
    "tiny": Preset(512, 128, 2, 4, 2, 256, 4096, 10000.0, False, 512, 0.1),
    # The demo's body under the mirror head (kind mirror-body): the tiny tokenizer and head
    # dim, but enough compute that a 511-token prefill costs ~80 ms on one core against ~5 ms
    # for 16 tokens, well above the HTTP path's noise, so runbook signal 3 is measurable.
    "demo": Preset(512, 256, 3, 8, 2, 768, 4096, 10000.0, False, 512, 0.1),
    # SmolLM2-135M's geometry, for benchmarks: compute, not only Python overhead.
    "smollm": Preset(49152, 576, 30, 9, 3, 1536, 8192, 100000.0, True, 512, 0.02),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for the 256 bytes (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _learn_merges(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE on the pre-tokenized corpus; ties broken by the pair itself (deterministic)."""
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for special in SPECIAL_TOKENS:
        corpus = corpus.replace(special, " ")
    words = Counter(piece for piece, _ in split.pre_tokenize_str(corpus))
    seqs: list[tuple[list[str], int]] = [(list(w), n) for w, n in sorted(words.items())]
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for syms, n in seqs:
            for pair in itertools.pairwise(syms):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        for syms, _ in seqs:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == best[0] and syms[i + 1] == best[1]:
                    syms[i : i + 2] = [joined]
                i += 1
    return merges


def build_tokenizer(size: int) -> Tokenizer:
    """Specials at ids 0..2, the 256 byte tokens, then learned merges up to `size` ids."""
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    merges = _learn_merges(_CORPUS, max(0, size - len(vocab)))
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def _config_json(p: Preset, tokenizer: Tokenizer) -> dict[str, Any]:
    bos = tokenizer.token_to_id(BOS_TOKEN)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": bos,
        "head_dim": p.hidden_size // p.num_heads,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": p.init_std,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": p.num_heads,
        "num_hidden_layers": p.num_layers,
        "num_key_value_heads": p.num_kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": p.rope_theta,
        "tie_word_embeddings": p.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": p.vocab_size,
    }


def _tokenizer_config(p: Preset, tokenizer: Tokenizer) -> dict[str, Any]:
    added = {
        str(tokenizer.token_to_id(s)): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": p.max_position_embeddings,
        "pad_token": BOS_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _weights(p: Preset, seed: int) -> dict[str, torch.Tensor]:
    """HF Llama parameter names; normal(0, init_std) matrices, norms near 1 (not exactly, so they matter)."""
    import torch  # deferred: finding the default checkpoint needs no torch

    gen = torch.Generator().manual_seed(seed)
    head_dim = p.hidden_size // p.num_heads
    h, q, kv, ff = (
        p.hidden_size,
        p.num_heads * head_dim,
        p.num_kv_heads * head_dim,
        p.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (p.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not p.tie_word_embeddings:
        shapes["lm_head.weight"] = (p.vocab_size, h)
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (q, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, q),
            pre + "mlp.gate_proj.weight": (ff, h),
            pre + "mlp.up_proj.weight": (ff, h),
            pre + "mlp.down_proj.weight": (h, ff),
        }
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        t = torch.empty(shapes[name], dtype=torch.float32)
        if name.endswith("norm.weight"):
            t.normal_(1.0, 0.05, generator=gen)
        else:
            t.normal_(0.0, p.init_std, generator=gen)
        out[name] = t
    return out


def _dump(path: Path, obj: Any) -> None:
    path.write_text(
        json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def make_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, preset: str = "tiny") -> Path:
    """Write a seeded random-weight checkpoint to `out_dir` (created if needed); return its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(p.tokenizer_size)
    if tokenizer.get_vocab_size(with_added_tokens=True) > p.vocab_size:
        raise ValueError("tokenizer larger than the model vocabulary")
    # tokenizers writes the vocab ordered by id; re-dumping fixes whitespace only.
    tok_json = json.loads(tokenizer.to_str())
    (out / "tokenizer.json").write_text(
        json.dumps(tok_json, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    _dump(out / "config.json", _config_json(p, tokenizer))
    _dump(out / "tokenizer_config.json", _tokenizer_config(p, tokenizer))
    _dump(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": BOS_TOKEN,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )
    _dump(
        out / "generation_config.json",
        {
            "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
            "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        },
    )
    from safetensors.torch import save_file  # deferred, like torch

    weights = out / "model.safetensors"
    save_file(_weights(p, seed), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # like the other files: peers may read it from another account
    return out


def default_cache_dir() -> Path:
    """`$KVFENCE_CACHE`, else ~/.cache/kvfence."""
    env = os.environ.get("KVFENCE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvfence"


def default_checkpoint_dir(*, preset: str = "tiny", seed: int = 0) -> Path:
    """The embedded default checkpoint, made on first use (atomically: temp dir, then rename)."""
    target = default_cache_dir() / "models" / f"{preset}-seed{seed}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make_tiny_checkpoint(tmp, seed=seed, preset=preset)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # lost a race to nobody: real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target
