"""Prefill-sized linears through oneDNN with packed weights: equal to torch's, repacked on load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfence.model import linear_cpu, linear_onednn

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
    gate_up_w, down_w = torch.randn(2 * 40, 48), torch.randn(48, 40)
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
