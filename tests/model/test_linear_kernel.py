"""The few-token linear kernel: built at install, equal to torch's linear, torch's path where it is not fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfence.model import linear_cpu


def test_the_linear_kernel_is_built_for_this_source() -> None:
    # `make install` builds it with the paged kernel; a missing build fails here.
    assert linear_cpu.CPULinear().has_kernel
    assert not linear_cpu.CPULinear(kernel=False).has_kernel


# The kernel's two paths (csrc/small_linear.cpp): features a multiple of 16 take the vector
# path (on AVX-512 blocks of 4 rows for one token, 3 rows x up to 8 tokens for 2-8, 6 rows x
# 4 tokens and one pass for the last 1-3 for more; on AVX2 only one token), other features
# the scalar tile. 48 and 640: vector; 100: scalar.
FEATURES = [48, 100, 640]


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 15, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_torch_linear(features: int, tokens: int, bias: bool) -> None:
    torch.manual_seed(tokens)
    x = torch.randn(tokens, features)
    # 70 rows: blocks of four (17, two left), three (23, one left) or six (11, four left), the
    # rest row by row
    w = torch.randn(70, features)
    b = torch.randn(70) if bias else None
    got = linear_cpu.CPULinear()(x, w, b)
    assert got.shape == (tokens, 70)
    assert torch.allclose(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def _avx512() -> bool:
    # The kernels are built with -march=native: this machine's flags are the build's.
    with open("/proc/cpuinfo") as f:
        return " avx512f" in f.read()


@pytest.mark.parametrize("features", [640, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_token_gets_the_same_bits_whatever_else_is_in_the_step(
    features: int, threads: int
) -> None:
    # Batch invariance: a token's outputs do not depend on how many other tokens share the
    # call, so a tenant's greedy output does not move with another tenant's decode load.
    # Every block shape (3 x 8; 6 x 4 and the one-pass rest; on AVX-512 4 x 1 for one token)
    # and the rows left after the blocks must sum each output as the same chain over K. On
    # AVX2 one token takes the vector path and more the scalar tile (csrc/small_linear.cpp):
    # there it holds from two tokens.
    torch.manual_seed(features)
    # 18 tokens: cut into calls of 2-16 tokens, no call is left with just one
    x, w, b = torch.randn(18, features), torch.randn(70, features), torch.randn(70)
    first = 1 if _avx512() or features % 16 else 2
    torch.set_num_threads(threads)  # conftest's autouse fixture restores it
    linear = linear_cpu.CPULinear()
    alone = torch.cat([linear(x[i : i + first], w, b) for i in range(0, 18, first)])
    for tokens in (2, 3, 5, 8, 9, 12, 15, 16):
        together = torch.cat([linear(x[i : i + tokens], w, b) for i in range(0, 18, tokens)])
        assert torch.equal(together, alone), tokens


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_the_scalar_tile_forced_equals_torch_linear(tokens: int) -> None:
    # vector=False: the scalar tile also where the vector path would run (bench/decode_linear.py).
    torch.manual_seed(tokens)
    x, w, b = torch.randn(tokens, 64), torch.randn(70, 64), torch.randn(70)
    got = linear_cpu.CPULinear(vector=False)(x, w, b)
    assert torch.allclose(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("features", [30, 32])
def test_kernel_result_depends_on_every_weight_row(features: int) -> None:
    # A kernel that skipped the remainder rows or a tile or a row would leave them stale or zero.
    x, w = torch.randn(3, features), torch.randn(9, features)
    linear = linear_cpu.CPULinear()
    base = linear(x, w)
    for n in range(9):
        bumped = w.clone()
        bumped[n] += 1.0
        changed = (linear(x, bumped) - base).abs().amax(dim=0) > 0
        assert changed.tolist() == [i == n for i in range(9)]


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(linear_cpu.SMALL_TOKENS + 1, 24),  # prefill-sized: oneDNN (or BLAS)
        torch.randn(24, 3).t(),  # not contiguous
        torch.randn(2, 24, dtype=torch.float64),  # not float32
    ],
)
def test_other_inputs_take_torch_linear(x: torch.Tensor) -> None:
    # oneDNN sums in its own order: equal to torch's linear within float32 rounding.
    w = torch.randn(8, 24, dtype=x.dtype)
    assert torch.allclose(linear_cpu.CPULinear()(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_a_feature_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="8 features, weight expects 6"):
        linear_cpu.CPULinear()(torch.randn(2, 8), torch.randn(4, 6))


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("tokens", [1, 4, 6, 16, 17])
def test_the_fused_norm_equals_rms_norm_then_linear(features: int, tokens: int) -> None:
    torch.manual_seed(tokens)
    x, norm = torch.randn(tokens, features) * 3, torch.rand(features) + 0.5
    w, b = torch.randn(70, features), torch.randn(70)
    want = F.linear(F.rms_norm(x, (features,), norm, 1e-5), w, b)
    got = linear_cpu.CPULinear().normed(x, norm, 1e-5, w, b)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    # The norm is really applied: without it the result is far off.
    assert not torch.allclose(linear_cpu.CPULinear()(x, w, b), want, atol=1e-2)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("tokens", [1, 5, 16, 17])
def test_the_fused_swiglu_and_residual_equal_torch(features: int, tokens: int) -> None:
    torch.manual_seed(tokens)
    gate_up, w = torch.randn(tokens, 2 * features), torch.randn(70, features)
    b, residual = torch.randn(70), torch.randn(tokens, 70)
    gate, up = gate_up.chunk(2, dim=-1)
    want = residual + F.linear(F.silu(gate) * up, w, b)
    linear = linear_cpu.CPULinear()
    assert torch.allclose(linear.glu(gate_up, w, b, residual=residual), want, atol=1e-4)
    x = torch.randn(tokens, features)
    assert torch.allclose(
        linear(x, w, b, residual=residual), residual + F.linear(x, w, b), atol=1e-4
    )
    # The residual is really added (a kernel that dropped it would match the bare linear).
    assert not torch.allclose(linear(x, w, b, residual=residual), F.linear(x, w, b), atol=1e-2)


@pytest.mark.parametrize("features", [96, 100])
@pytest.mark.parametrize("threads", [2, 3])
def test_the_kernel_on_its_pool_threads_equals_torch_linear(threads: int, features: int) -> None:
    # The weight rows split into `threads` shares (csrc/spin_pool.h): none lost or doubled,
    # also when the shares are uneven (70 rows: 8 blocks of eight and six rows left on the
    # vector path, 17 tiles of four and two left on the scalar one),
    # on both paths (96 features: the vector path; 100: the scalar tile).
    torch.manual_seed(threads)
    x, w, b = torch.randn(5, features), torch.randn(70, features), torch.randn(70)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(50):  # many calls: each must see its own work, not the last one's
            x = x + 0.01
            assert torch.allclose(linear_cpu.CPULinear()(x, w, b), F.linear(x, w, b), atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_two_callers_at_once_each_get_their_own_result() -> None:
    # One caller runs on the pool; a concurrent one runs its work on its own thread.
    import threading

    torch.manual_seed(7)
    w = torch.randn(256, 64)
    xs = [torch.randn(2, 64) for _ in range(4)]
    wrong: list[int] = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)

    def call(i: int) -> None:
        for _ in range(200):
            if not torch.allclose(linear_cpu.CPULinear()(xs[i], w), F.linear(xs[i], w), atol=1e-4):
                wrong.append(i)

    try:
        callers = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
    finally:
        torch.set_num_threads(before)
    assert wrong == []


@pytest.mark.parametrize("tokens", [1, 6])
def test_the_fused_swiglu_holds_at_extreme_gates(tokens: int) -> None:
    # The kernel's sigmoid comes from exp(-|gate|): no overflow at +-100, and SiLU's
    # saturation (silu(100) = 100, silu(-100) ~ 0) matches torch's.
    gate = torch.linspace(-100.0, 100.0, 64).repeat(tokens, 1)
    up = torch.randn(tokens, 64)
    w = torch.eye(64)
    got = linear_cpu.CPULinear().glu(torch.cat([gate, up], dim=1), w)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, F.silu(gate) * up, atol=1e-4, rtol=1e-5)
