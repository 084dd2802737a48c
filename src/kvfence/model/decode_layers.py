"""A decode step's decoder layers in one kernel call (`csrc/decode_layers.cpp`).

At a handful of tokens the Python that calls a layer's kernels one by one
(seven ctypes calls, two `index_copy_`, views, checks) costs about 0.1 ms a
layer: 3 ms of a 25 ms one-token step on a 30-layer model, 9 ms of an 82 ms
16-row step (`bench/engine_step.py --compare fused`). The C++ entry point runs
the same kernels in the same order, so the output is bitwise the per-layer
path's; only the calls between them leave Python.

It applies to decode-only steps of one pool with float32 weights, pool and
activations, every kernel built, and at most `SMALL_TOKENS` rows (the few-token
linear's range). Anything else (prefill rows, other dtypes, several pools) takes
the per-layer path. The page tables are verified before the call (I1,
`attention.begin_step`), as for the per-layer path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from kvfence.kv.pool import KVPool
from kvfence.model.attention import AttentionBackend, AttentionPlan, CPUAttention
from kvfence.model.config import ModelConfig
from kvfence.model.linear_cpu import SMALL_TOKENS, CPULinear
from kvfence.model.paged_cpu import library
from kvfence.model.rows_cpu import RowOps, f32_contiguous

# One layer's parameters in decode_layers.cpp's LayerWeights order (None: no bias).
WEIGHT_NAMES = (
    "input_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias",
    "post_norm", "gate_up_weight", "gate_up_bias", "down_weight", "down_bias",
)  # fmt: skip


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in WEIGHT_NAMES]


class _Step(ctypes.Structure):
    """decode_layers.cpp's Step, field for field."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("tokens", "layers", "hidden", "heads", "kv_heads")],
        *[(n, ctypes.c_int64) for n in ("head_dim", "ff", "page_size", "pool_pages")],
        ("table_width", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(n, ctypes.c_int) for n in ("threads", "vector_linear", "vector_attention")],
        ("weights", ctypes.POINTER(_LayerWeights)),
        *[(n, ctypes.c_void_p) for n in ("cos", "sin", "k_pool", "v_pool", "slots", "table")],
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
    ]


class DecodeModel(Protocol):
    """What the fused step reads of a model (model.llama.LlamaModel)."""

    config: ModelConfig
    scale: float
    linear: CPULinear
    backend: AttentionBackend
    layers: torch.nn.ModuleList


class FusedDecode:
    """`run(model, ...)`: a decode-only step's layers in one call, or None where it does not apply.

    The model's kernels are read at each call, so a model whose linear or attention
    backend is swapped (bench, tests) follows. The layers' parameter pointers are
    packed once and re-packed whenever one of them has moved (a load, a dtype
    change): the key is every pointer, read each step (about 40 us at 30 layers).
    """

    def __init__(self) -> None:
        lib = library()
        self._fn = None if lib is None else lib.kvf_decode_layers
        if self._fn is not None:
            self._fn.restype = ctypes.c_int
            self._fn.argtypes = [ctypes.POINTER(_Step), ctypes.c_void_p]
        self._key: tuple[int, ...] | None = None
        self._weights: ctypes.Array[_LayerWeights] | None = None

    @property
    def has_kernel(self) -> bool:
        return self._fn is not None

    def applies(
        self, model: DecodeModel, x: torch.Tensor, pool: KVPool, plan: AttentionPlan
    ) -> bool:
        """Every kernel built, a decode-only step in the few-token range, float32 throughout."""
        backend = model.backend
        # Exact types: a subclass may override a kernel's call, which this path would skip.
        return (
            self._fn is not None
            and type(model.linear) is CPULinear
            and model.linear.has_kernel
            and type(model.linear.rows) is RowOps
            and model.linear.rows.has_kernel
            and type(backend) is CPUAttention
            and backend.kernel is not None
            and plan.decode_is_all
            and x.shape[0] <= SMALL_TOKENS
            and f32_contiguous(x)
            and f32_contiguous(pool.k)
            and f32_contiguous(pool.v)
        )

    def run(
        self,
        model: DecodeModel,
        x: torch.Tensor,
        pool: KVPool,
        plan: AttentionPlan,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """x [T, hidden] through every layer (cos, sin: [T, 1, head_dim / 2]); None, with
        nothing run, where the fused call does not apply."""
        c = model.config
        if not self.applies(model, x, pool, plan) or cos.shape != (x.shape[0], 1, c.head_dim // 2):
            return None
        layers = list(model.layers)
        weights = self._packed(layers)
        if weights is None or not (f32_contiguous(cos) and f32_contiguous(sin)):
            return None
        if pool.geometry.num_kv_heads != c.num_kv_heads or pool.geometry.head_dim != c.head_dim:
            raise ValueError("decode step: the pool's KV heads do not match the model's")
        table = plan.batch.pages.pages.contiguous()
        slots = plan.batch.slot_mapping.contiguous()
        bounds = [plan.decode_bounds(getattr(layer, "window", None)) for layer in layers]
        lo = torch.stack([b[0] for b in bounds]).contiguous()
        hi = torch.stack([b[1] for b in bounds]).contiguous()
        out = x.clone()  # the kernel writes each layer's output over it
        assert isinstance(model.backend, CPUAttention)
        step = _Step(
            x.shape[0], len(layers), x.shape[1], c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, pool.page_size, pool.num_pages, table.shape[1],
            c.rms_norm_eps, model.scale,
            torch.get_num_threads(), int(model.linear.vector), int(model.backend.vector),
            weights, cos.data_ptr(), sin.data_ptr(), pool.k.data_ptr(), pool.v.data_ptr(),
            slots.data_ptr(), table.data_ptr(), lo.data_ptr(), hi.data_ptr(),
        )  # fmt: skip
        assert self._fn is not None
        bad = self._fn(ctypes.byref(step), out.data_ptr())
        if bad == 1:
            raise ValueError("paged kernel: a page table names a page outside the pool")
        if bad == 2:
            raise IndexError("decode step: a slot lies outside the pool")
        return out

    def _packed(self, layers: Sequence[torch.nn.Module]) -> ctypes.Array[_LayerWeights] | None:
        params = [[getattr(layer, n) for n in WEIGHT_NAMES] for layer in layers]
        key = tuple(0 if p is None else p.data_ptr() for ps in params for p in ps)
        if key != self._key:
            ok = all(p is None or f32_contiguous(p) for ps in params for p in ps)
            rows = [
                _LayerWeights(*(None if p is None else p.data_ptr() for p in ps)) for ps in params
            ]
            self._weights = (_LayerWeights * len(rows))(*rows) if ok else None
            self._key = key
        return self._weights
