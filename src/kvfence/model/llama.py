"""Llama-family decoder (Llama, Qwen2, Mistral) on the paged KV pool.

The math follows Hugging Face's modeling code (RMSNorm in float32, RoPE with
`rope_theta` and linear/llama3 scaling, grouped-query attention, SwiGLU), with
q/k/v and gate/up fused into one matmul each. K/V are only written at the
batch's slots and only read through its page tables (`attention.begin_step`
verifies them once per step, I1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvfence.kv.pool import KVPool
from kvfence.model.attention import AttentionBackend, AttentionPlan, begin_step, get_backend
from kvfence.model.base import CausalLM, ForwardBatch
from kvfence.model.config import ModelConfig, RopeScaling
from kvfence.model.decode_layers import FusedDecode
from kvfence.model.linear_cpu import CPULinear


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies as HF computes them (`default`, `linear`, `llama3`)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.index = index
        self.window = c.window_for_layer(index)
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_size, self.kv_size = q, kv
        self.input_norm = _param(torch.ones(c.hidden_size, dtype=dtype))
        self.post_norm = _param(torch.ones(c.hidden_size, dtype=dtype))
        self.qkv_weight = _param(torch.empty(q + 2 * kv, c.hidden_size, dtype=dtype))
        self.qkv_bias = _param(torch.zeros(q + 2 * kv, dtype=dtype)) if c.qkv_bias else None
        self.o_weight = _param(torch.empty(c.hidden_size, q, dtype=dtype))
        self.o_bias = _param(torch.zeros(c.hidden_size, dtype=dtype)) if c.o_bias else None
        ff = c.intermediate_size
        self.gate_up_weight = _param(torch.empty(2 * ff, c.hidden_size, dtype=dtype))
        self.gate_up_bias = _param(torch.zeros(2 * ff, dtype=dtype)) if c.mlp_bias else None
        self.down_weight = _param(torch.empty(c.hidden_size, ff, dtype=dtype))
        self.down_bias = _param(torch.zeros(c.hidden_size, dtype=dtype)) if c.mlp_bias else None

    def forward(
        self,
        x: torch.Tensor,
        model: LlamaModel,
        parts: Sequence[_Part],
        cos: torch.Tensor,
        sin: torch.Tensor,
        keep: _Keep | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] for every part's tokens: one matmul per weight, attention per pool.

        With `keep`, every token's K/V is still written but only the kept tokens attend,
        project and run the MLP: the result is [len(keep.tokens), hidden].
        """
        c = model.config
        t = x.shape[0]
        linear = model.linear
        qkv = linear.normed(x, self.input_norm, c.rms_norm_eps, self.qkv_weight, self.qkv_bias)
        # q and k are adjacent in the fused projection: rotate them in one go.
        qk = linear.rows.rope(
            qkv[:, : self.q_size + self.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim),
            cos,
            sin,
        )
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        for p in parts:  # each part's new K/V into its own pool, before any of them attends
            model.backend.write(
                p.pool, self.index, p.batch.slot_mapping, k[p.lo : p.hi], v[p.lo : p.hi]
            )
        if keep is not None:
            parts, q, x = keep.parts, q[keep.tokens], x[keep.tokens]
        o = self._attend(model, parts, q)
        x = linear(o, self.o_weight, self.o_bias, residual=x)
        return linear.mlp(
            x, self.post_norm, c.rms_norm_eps,
            self.gate_up_weight, self.gate_up_bias, self.down_weight, self.down_bias,
        )  # fmt: skip

    def _attend(self, model: LlamaModel, parts: Sequence[_Part], q: torch.Tensor) -> torch.Tensor:
        """Each part's queries through its own verified tables, in its own pool."""
        b = model.backend
        if len(parts) == 1:
            p = parts[0]
            return b.attend(p.pool, self.index, q, p.plan, scale=model.scale, window=self.window)
        return torch.cat(
            [
                b.attend(
                    p.pool,
                    self.index,
                    q[p.lo : p.hi],
                    p.plan,
                    scale=model.scale,
                    window=self.window,
                )
                for p in parts
            ]
        )


@dataclass(slots=True)
class _Part:
    """One pool's rows in a step: its batch, its attention plan, its tokens' range [lo, hi)."""

    batch: ForwardBatch
    pool: KVPool
    plan: AttentionPlan
    lo: int
    hi: int

    def logit_rows(self) -> torch.Tensor:
        """Indices (into the step's tokens) of the tokens this part wants logits for."""
        if self.batch.all_logits:
            return torch.arange(self.lo, self.hi)
        return self.batch.query_starts[1:] - 1 + self.lo

    def logit_part(self, backend: AttentionBackend, dtype: torch.dtype, lo: int) -> _Part:
        """This part cut to the tokens it wants logits for, at [lo, ...) of the kept tokens.

        Cut to each row's last token it is a decode-shaped batch over the same verified
        page tables (`begin_step` ran on them) and the same lengths: that token attends the
        keys it would have attended in the whole step.
        """
        if self.batch.all_logits:
            return _Part(self.batch, self.pool, self.plan, lo, lo + self.hi - self.lo)
        b = self.batch
        last = b.query_starts[1:] - 1
        cut = replace(
            b,
            input_ids=b.input_ids[last],
            positions=b.positions[last],
            slot_mapping=b.slot_mapping[last],
            query_starts=torch.arange(b.num_rows + 1),
        )
        return _Part(cut, self.pool, backend.plan(self.pool, cut, dtype), lo, lo + b.num_rows)


@dataclass(frozen=True, slots=True)
class _Keep:
    """The last layer's kept tokens (indices into the step's) and the parts cut to them."""

    tokens: torch.Tensor
    parts: list[_Part]


class LlamaModel(CausalLM):
    """A Llama-family decoder whose KV lives in a `KVPool`. Build with `from_hf_weights`."""

    inv_freq: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        backend: AttentionBackend | None = None,
        linear: CPULinear | None = None,
        fuse_decode: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backend = backend or get_backend("cpu")
        self.linear = linear or CPULinear()
        # Decode-only steps: every layer in one kernel call (False: one call per kernel).
        self.fused = FusedDecode() if fuse_decode else None
        self.scale = config.head_dim**-0.5
        self.embed = _param(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = _param(torch.ones(config.hidden_size, dtype=dtype))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _param(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        )
        self.register_buffer(
            "inv_freq",
            rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
            persistent=False,
        )

    # ---- weights ------------------------------------------------------------------------

    @classmethod
    def from_hf_weights(
        cls,
        config: ModelConfig,
        tensors: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        backend: AttentionBackend | None = None,
    ) -> LlamaModel:
        """Build from HF parameter names; raise ValueError naming missing or unexpected ones."""
        model = cls(config, dtype=dtype, backend=backend)
        model.load_hf_weights(tensors)
        return model

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        w = _Weights(tensors)
        w.put(self.embed, "model.embed_tokens.weight")
        w.put(self.norm, "model.norm.weight")
        if self.lm_head is not None:
            w.put(self.lm_head, "lm_head.weight")
        elif "lm_head.weight" in tensors:
            w.used.add("lm_head.weight")  # tied: some checkpoints store the copy anyway
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            _load_layer(w, layer, f"model.layers.{i}.", self.config)
        w.check_all_used()
        self.linear.forget_packed()
        self._pack_layers()

    def _pack_layers(self) -> None:
        """oneDNN's packed copies of the layers' float32 weights, made now, at load.

        Their memory is then taken before the server sizes its KV pool from what is left
        (serve/build.py), and no request's prefill pays for packing.
        """
        packed = self.linear.packed
        if packed is None or self.dtype != torch.float32:
            return
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            packed.pack(layer.qkv_weight)
            packed.pack(layer.o_weight)
            packed.pack_mlp(layer.gate_up_weight, layer.down_weight)

    # ---- forward ------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        return self.forward_many([(batch, pool)])[0]

    def forward_many(self, parts: Sequence[tuple[ForwardBatch, KVPool]]) -> list[torch.Tensor]:
        """Every part's tokens through each weight once; each part attends only in its own pool."""
        if not parts:
            raise ValueError("forward_many needs at least one part")
        with torch.inference_mode():
            for batch, pool in parts:
                begin_step(pool, batch)  # I1 for every part, before any write or gather
            steps = self._plan(parts)
            positions = (
                torch.cat([b.positions for b, _ in parts])
                if len(parts) > 1
                else parts[0][0].positions
            )
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
            cos = freqs.cos().to(self.dtype)[:, None, :]
            sin = freqs.sin().to(self.dtype)[:, None, :]
            ids = (
                torch.cat([b.input_ids for b, _ in parts])
                if len(parts) > 1
                else parts[0][0].input_ids
            )
            x = F.embedding(ids, self.embed)
            rows = [p.logit_rows() for p in steps]
            keep = torch.cat(rows)
            fused = self._fused(x, steps, cos, sin)
            x = fused[keep] if fused is not None else self._layers(x, steps, keep, cos, sin)
            head = self.embed if self.lm_head is None else self.lm_head
            logits = self.linear.normed(x, self.norm, self.config.rms_norm_eps, head).float()
            return list(logits.split([r.numel() for r in rows]))

    def _layers(
        self,
        x: torch.Tensor,
        steps: list[_Part],
        keep: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Every layer over the step's tokens, the last one's output only at `keep` [K, hidden].

        Only the kept tokens' last hidden states reach the head, so the last layer writes
        every token's K/V (later steps attend over them) but attends, projects and runs
        its MLP for the kept tokens alone: in a prefill step, one token a prompt, which
        saves about 1 / num_layers of the step's matmuls.
        """
        *body, last = self.layers
        for layer in body:
            x = layer(x, self, steps, cos, sin)
        if keep.numel() == x.shape[0]:  # every token wants logits, in order
            return last(x, self, steps, cos, sin)
        parts, lo = [], 0
        for p in steps:
            parts.append(p.logit_part(self.backend, self.dtype, lo))
            lo = parts[-1].hi
        return last(x, self, steps, cos, sin, keep=_Keep(keep, parts))

    def _fused(
        self, x: torch.Tensor, steps: list[_Part], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """Every layer in one call where the step is decode-only over one pool, else None."""
        if self.fused is None or len(steps) != 1:
            return None
        return self.fused.run(self, x, steps[0].pool, steps[0].plan, cos, sin)

    def _plan(self, parts: Sequence[tuple[ForwardBatch, KVPool]]) -> list[_Part]:
        steps, lo = [], 0
        for batch, pool in parts:
            hi = lo + int(batch.input_ids.numel())
            steps.append(_Part(batch, pool, self.backend.plan(pool, batch, self.dtype), lo, hi))
            lo = hi
        return steps


class _Weights:
    """A checkpoint's tensors, copied into parameters by name; every one used exactly once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.used: set[str] = set()
        self.missing: list[str] = []

    def take(self, name: str) -> torch.Tensor | None:
        if name not in self.tensors:
            self.missing.append(name)
            return None
        self.used.add(name)
        return self.tensors[name]

    def put(self, dst: torch.nn.Parameter | None, *names: str) -> None:
        """Copy the named tensors (stacked on dim 0, e.g. q+k+v) into `dst`, each straight into
        its rows: no concatenated copy (on a 135M checkpoint that copy was half the load)."""
        parts = [t for t in map(self.take, names) if t is not None]
        if dst is None or len(parts) < len(names):
            return
        rows = sum(int(t.shape[0]) for t in parts)
        shape = (rows, *parts[0].shape[1:])
        if tuple(dst.shape) != shape or any(t.shape[1:] != parts[0].shape[1:] for t in parts):
            got = " + ".join(str(tuple(t.shape)) for t in parts)
            raise ValueError(
                f"weight {'+'.join(names)} has shape {got}, expected {tuple(dst.shape)}"
            )
        lo = 0
        for t in parts:
            dst.data[lo : lo + t.shape[0]].copy_(t)  # copy_ casts to the parameter's dtype
            lo += int(t.shape[0])

    def check_all_used(self) -> None:
        unexpected = sorted(
            n for n in self.tensors if n not in self.used and not n.endswith("rotary_emb.inv_freq")
        )
        missing = self.missing
        if missing or unexpected:
            raise ValueError(
                "checkpoint does not match the config: "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )


def _load_layer(w: _Weights, layer: DecoderLayer, p: str, c: ModelConfig) -> None:
    a, m = p + "self_attn.", p + "mlp."
    w.put(layer.input_norm, p + "input_layernorm.weight")
    w.put(layer.post_norm, p + "post_attention_layernorm.weight")
    w.put(layer.qkv_weight, a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
    w.put(layer.o_weight, a + "o_proj.weight")
    w.put(layer.gate_up_weight, m + "gate_proj.weight", m + "up_proj.weight")
    w.put(layer.down_weight, m + "down_proj.weight")
    if c.qkv_bias:
        w.put(layer.qkv_bias, a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
    if c.o_bias:
        w.put(layer.o_bias, a + "o_proj.bias")
    if c.mlp_bias:
        w.put(layer.gate_up_bias, m + "gate_proj.bias", m + "up_proj.bias")
        w.put(layer.down_bias, m + "down_proj.bias")
