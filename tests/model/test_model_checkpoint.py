"""Tiny checkpoints (deterministic, HF layout), the loader's errors, `kvfence make-model`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from kvmodel_helpers import make_pool, new_seq, step
from safetensors.torch import load_file, save_file

from kvfence.cli import main
from kvfence.model.config import UnsupportedModelError
from kvfence.model.loader import ModelFilesError, load_model
from kvfence.model.mirror import MirrorModel
from kvfence.model.tiny import default_checkpoint_dir, make_tiny_checkpoint

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_is_byte_identical_other_seed_is_not(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    again = _files(make_tiny_checkpoint(tmp_path / "again", seed=0))
    assert again == _files(tiny_checkpoint)
    assert tuple(again) == FILES
    other = _files(make_tiny_checkpoint(tmp_path / "other", seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"]


def test_tiny_layout_is_the_hf_llama_layout(tiny_checkpoint: Path) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU (PEERS.md)
    tok = json.loads((tiny_checkpoint / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "BPE" and tok["pre_tokenizer"]["type"] == "ByteLevel"
    assert len(tok["model"]["vocab"]) == config["vocab_size"] == 512
    names = set(load_file(str(tiny_checkpoint / "model.safetensors")))
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert "chat_template" in json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())


def test_make_model_cli_writes_the_same_checkpoint(tmp_path: Path, tiny_checkpoint: Path) -> None:
    result = CliRunner().invoke(main, ["make-model", str(tmp_path / "m"), "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert "wrote tiny checkpoint" in result.output
    assert _files(tmp_path / "m") == _files(tiny_checkpoint)


def test_default_checkpoint_is_made_once_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFENCE_CACHE", str(tmp_path / "cache"))
    first = default_checkpoint_dir()
    assert first.is_relative_to(tmp_path / "cache")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_checkpoint_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dir left behind


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_loader_names_the_missing_file(tmp_path: Path, tiny_checkpoint: Path, missing: str) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m", skip=(missing,))
    with pytest.raises(ModelFilesError, match=missing.replace(".", r"\.")):
        load_model(d)


def test_loader_refuses_unsupported_architecture(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(d)


def test_sharded_checkpoint_loads_to_the_same_logits(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "sharded", skip=("model.safetensors",))
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard))
    index = {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))

    def logits(directory: Path) -> torch.Tensor:
        loaded = load_model(directory)
        pool = make_pool(loaded.config, 4)
        return step(loaded.model, pool, [(new_seq(pool, [5, 6, 7, 8], 8), 4)])

    assert torch.equal(logits(d), logits(tiny_checkpoint))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFilesError, match="model-00002-of-00002"):
        load_model(d)


def test_mirror_kind_needs_no_weights(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "m", skip=("model.safetensors",))
    loaded = load_model(d, kind="mirror")
    assert isinstance(loaded.model, MirrorModel)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("echo")) == "echo"
    with pytest.raises(ValueError, match="unknown model kind"):
        load_model(d, kind="gpt")


def test_bfloat16_weights_return_float32_logits(tiny_checkpoint: Path) -> None:
    loaded = load_model(tiny_checkpoint, dtype="bfloat16")
    pool = make_pool(loaded.config, 4)
    out = step(loaded.model, pool, [(new_seq(pool, [1, 2, 3], 8), 3)])
    assert out.dtype == torch.float32 and out.shape == (1, 512) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "model.norm.weight"])
def test_a_weight_of_the_wrong_shape_is_named(
    tmp_path: Path, tiny_checkpoint: Path, name: str
) -> None:
    # A fused parameter (q+k+v) and a plain one: each part lands in its own rows, so a part
    # of the wrong shape must be refused by name, never copied into a neighbour's rows.
    d = _copy(tiny_checkpoint, tmp_path / "bad", skip=("model.safetensors",))
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=f"weight .*{name}.* has shape"):
        load_model(d)
