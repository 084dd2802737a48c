"""ModelConfig parsing of HF config.json for the supported architectures."""

from __future__ import annotations

from typing import Any

import pytest

from kvfence.model.config import ModelConfig, UnsupportedModelError

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


def test_llama_defaults_and_derived_values() -> None:
    c = ModelConfig.from_dict(BASE)
    assert (c.head_dim, c.group_size, c.rope_theta, c.tie_word_embeddings) == (
        32,
        4,
        10000.0,
        False,
    )
    assert not c.qkv_bias and c.sliding_window is None and c.window_for_layer(0) is None
    g = c.kv_geometry(page_size=8, dtype="bfloat16")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.page_size, g.dtype) == (
        3,
        2,
        32,
        8,
        "bfloat16",
    )


def test_qwen2_biases_explicit_head_dim_and_eos_list() -> None:
    c = ModelConfig.from_dict(
        BASE | {"architectures": ["Qwen2ForCausalLM"], "head_dim": 64, "eos_token_id": [5, 7]}
    )
    assert c.qkv_bias and not c.o_bias and c.head_dim == 64 and c.eos_token_ids == (5, 7)


def test_qwen2_window_applies_from_max_window_layers() -> None:
    c = ModelConfig.from_dict(
        BASE
        | {
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 2,
        }
    )
    assert [c.window_for_layer(i) for i in range(3)] == [None, None, 64]


def test_mistral_window_and_rope_parameters_format() -> None:
    c = ModelConfig.from_dict(
        BASE
        | {
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 128,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
        }
    )
    assert c.window_for_layer(2) == 128
    assert (
        c.rope_theta == 5e5
        and c.rope_scaling.rope_type == "llama3"
        and c.rope_scaling.factor == 8.0
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["PhiForCausalLM"]}, r"PhiForCausalLM.*supported: LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ],
)
def test_unsupported_features_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict(BASE | change)


def test_missing_field_and_bad_geometry_are_errors() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_dict(BASE | {"num_key_value_heads": 3})
