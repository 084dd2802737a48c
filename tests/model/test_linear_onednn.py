"""Prefill-sized linears through oneDNN with packed weights: equal to torch's, repacked on load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kvmodel_helpers import make_pool, new_seq, step

from kvfence.model import linear_cpu, linear_onednn
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.rows_cpu import RowOps, torch_rms_norm, torch_rope

ROWS = linear_cpu.SMALL_TOKENS + 1


def test_this_build_has_onednn() -> None:
    # Without it prefill silently falls back to MKL (measured 1.3-2.5x slower here).
    assert linear_onednn.available()
    assert linear_cpu.CPULinear().packed is not None
    assert linear_cpu.CPULinear(onednn=False).packed is None


@pytest.mark.parametrize("tokens", [ROWS, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_and_residual_equal_torch(tokens: int, bias: bool) -> None:
    torch.manual_seed(tokens)
    x, w = torch.randn(tokens, 96), torch.randn(70, 96)
    b = torch.randn(70) if bias else None
    residual = torch.randn(tokens, 70)
    linear = linear_cpu.CPULinear()
    assert torch.allclose(linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    got = linear(x, w, b, residual=residual)
    assert torch.allclose(got, residual + F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(got, F.linear(x, w, b), atol=1e-2)  # the residual is added


@pytest.mark.parametrize("tokens", [4, ROWS, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_equals_norm_swiglu_down_residual(tokens: int, bias: bool) -> None:
    torch.manual_seed(tokens)
    x, norm = torch.randn(tokens, 48) * 2, torch.rand(48) + 0.5
    gate_up_w, down_w = torch.randn(2 * 40, 48) * 0.2, torch.randn(48, 40) * 0.2
    gate_up_b, down_b = (torch.randn(80), torch.randn(48)) if bias else (None, None)
    h = F.rms_norm(x, (48,), norm, 1e-5)
    gate, up = F.linear(h, gate_up_w, gate_up_b).chunk(2, dim=-1)
    want = x + F.linear(F.silu(gate) * up, down_w, down_b)
    got = linear_cpu.CPULinear().mlp(x, norm, 1e-5, gate_up_w, gate_up_b, down_w, down_b)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    # gate and up are not interchangeable: swapping them must change the result.
    swapped = torch.cat((gate_up_w[40:], gate_up_w[:40]))
    other = linear_cpu.CPULinear().mlp(x, norm, 1e-5, swapped, None, down_w, down_b)
    assert not torch.allclose(other, got, atol=1e-2)


def test_weights_changed_in_place_are_repacked_after_forget() -> None:
    x, w = torch.randn(ROWS, 32), torch.randn(16, 32)
    linear = linear_cpu.CPULinear()
    before = linear(x, w)
    w.add_(1.0)
    assert torch.allclose(linear(x, w), before)  # still the packed copy of the old weights
    linear.forget_packed()
    assert torch.allclose(linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 64, 130])
def test_kv_write_reads_the_fused_projection_in_place_like_index_copy(tokens: int) -> None:
    """K and V as the model passes them (views into the fused qkv output) land in their slots
    exactly as torch's index_copy_ puts them; every other slot keeps its bytes."""
    torch.manual_seed(tokens)
    rows = RowOps()
    qkv = torch.randn(tokens, (4 + 2 + 2) * 16)
    k, v = qkv[:, 64:96].view(tokens, 2, 16), qkv[:, 96:].view(tokens, 2, 16)
    slots = torch.randperm(200)[:tokens]
    k_pool, v_pool = torch.randn(200, 2, 16), torch.randn(200, 2, 16)
    pools = [k_pool, v_pool, k_pool.clone(), v_pool.clone()]
    rows.write_kv(pools[0], pools[1], slots, k, v)
    pools[2].index_copy_(0, slots, k)
    pools[3].index_copy_(0, slots, v)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@pytest.mark.parametrize("bad", [200, -1])
def test_kv_write_refuses_a_slot_outside_the_layer_and_writes_nothing(bad: int) -> None:
    """The kernel checks every slot before it writes any: the good slots before the bad one
    are not written either (a batch is written whole or not at all)."""
    rows = RowOps()
    k, v = torch.ones(3, 2, 16), torch.ones(3, 2, 16)
    k_slots, v_slots = torch.zeros(200, 2, 16), torch.zeros(200, 2, 16)
    with pytest.raises(IndexError, match="outside the layer's 200 slots"):
        rows.write_kv(k_slots, v_slots, torch.tensor([5, 6, bad]), k, v)
    assert not k_slots.any() and not v_slots.any()


@pytest.mark.parametrize("tokens", [1, 5, 64, 130])
def test_row_kernels_equal_torch_norm_and_rope(tokens: int) -> None:
    torch.manual_seed(tokens)
    rows = RowOps()
    assert rows.has_kernel and not RowOps(kernel=False).has_kernel
    x, w = torch.randn(tokens, 96) * 3, torch.rand(96) + 0.5
    assert torch.allclose(rows.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), atol=1e-5)
    # RoPE on the q/k heads of a fused projection, in place, v untouched.
    qkv = torch.randn(tokens, 5 * 16)
    freqs = torch.arange(tokens).float()[:, None] * (1e-2 ** (torch.arange(8) / 8))[None]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    want = torch_rope(qkv[:, :64].reshape(tokens, 4, 16), cos, sin)
    v, before = qkv[:, 64:].clone(), qkv[:, :64].clone()
    got = rows.rope(qkv[:, :64].view(tokens, 4, 16), cos, sin)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(qkv[:, 64:], v)
    # Position 0 is the identity; any later one really rotates.
    assert tokens == 1 or not torch.allclose(got.reshape(tokens, 64), before, atol=1e-3)


def test_the_layers_are_packed_at_load_and_a_prefill_packs_nothing_more(
    tiny_checkpoint: Path,
) -> None:
    # Packed at load: their memory is taken before a server sizes its pool from what is left,
    # and no request's prefill pays for packing. A view the forward passes that the load did
    # not pack would add an entry here.
    loaded = load_model(tiny_checkpoint)
    model = loaded.model
    assert isinstance(model, LlamaModel) and model.linear.packed is not None
    assert len(model.linear.packed) == 5 * model.config.num_layers
    pool = make_pool(model.config, 64)
    seq = new_seq(pool, list(range(3, 3 + 40)), 41)  # 40 tokens: prefill-sized, oneDNN's
    step(model, pool, [(seq, 40)])
    assert len(model.linear.packed) == 5 * model.config.num_layers
