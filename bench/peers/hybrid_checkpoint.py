"""A hybrid (Mamba2 + attention) checkpoint with seeded random weights, in a real HF layout.

    make_hybrid_checkpoint(out_dir, tokenizer_from=tiny_dir, cache=cache)

The model is transformers' own `GraniteMoeHybridForCausalLM` with no experts (dense: Mamba2
mixers and one attention layer, each followed by a shared MLP; vLLM 0.32 no longer lists
`BambaForCausalLM` and hands it to its Transformers fallback, which cannot run Mamba layers),
built from its config in the vLLM peer's venv so the config and weight names are those the
engine's transformers writes and vLLM's loader reads. The tokenizer files come from the
project's tiny checkpoint (byte-level BPE), so any text tokenizes. vLLM runs such a model
with two KV-cache groups drawn from one block pool, which is what makes
`num_gpu_blocks x block_size` the wrong pool figure and `kv_cache_size_tokens` the right one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .cache import PeerCache

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

# The smallest shapes vLLM's CPU Mamba2 kernels and attention take: head dim 32 for
# attention (vLLM CPU's minimum), Mamba2 heads x head dim = expand x hidden.
HYBRID_CONFIG: dict[str, object] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "shared_intermediate_size": 256,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "mamba", "attention", "mamba"],
    "position_embedding_type": "rope",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Runs in the peer's venv (its torch and transformers): argv = out dir, config JSON, seed.
_BUILD = """
import json, sys
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
out, cfg, seed = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
cfg.pop("architectures", None)
torch.manual_seed(seed)
model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**cfg)).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
"""


def make_hybrid_checkpoint(
    out_dir: str | Path, *, tokenizer_from: Path, cache: PeerCache, seed: int = 0
) -> Path:
    """Write the hybrid checkpoint to `out_dir` (the tokenizer copied from `tokenizer_from`)."""
    cache.require("vllm")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_cfg = json.loads((tokenizer_from / "config.json").read_text(encoding="utf-8"))
    config = dict(HYBRID_CONFIG)
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = tok_cfg[key]
    done = subprocess.run(
        [str(cache.vllm_python), "-c", _BUILD, str(out), json.dumps(config), str(seed)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"building the hybrid checkpoint in {cache.vllm_python} exited {done.returncode}: "
            f"{done.stderr[-2000:]}"
        )
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_from / name, out / name)
    for path in out.iterdir():
        path.chmod(0o644)  # peers may read it from another account
    return out
