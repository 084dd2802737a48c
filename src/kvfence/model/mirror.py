"""The mirror model: a diagnostic decoder that replays the token content of the KV it reads.

Each new token's id is written into its K and V (three base-256 digits, exact
in float32, bfloat16 and float16). A row's next token is the id stored at
attended position `num_generated[row]`, read back through the same paged
`gather` as the real model and nothing else — no Python-side copy of the
prompt. With correct isolation a request therefore echoes its own prompt in
order (then its own echo); any cross-page or stale read surfaces another
request's tokens verbatim (docs/ARCHITECTURE.md, "The model and its kernels").

Weightless, the mirror's prefill costs nothing, so runbook signal 3 (a long
prompt answered as fast as a short one) cannot be told from noise. Built
with a `body` (kind ``mirror-body``: the checkpoint's real Llama weights),
every step that prefills (some row has generated nothing yet) first runs the
real transformer over the batch through the same paged attention — its cost
grows with the prompt like any engine's — and its logits are discarded. A
decode-only step skips the body: no check times decode and the echo does not
need it (a demo decode token costs ~1.7 ms instead of ~3.8). The mirror head
then writes the ids over the body's KV and echoes as above, so leaks still
read as text. The body's KV for earlier positions is therefore the mirror's
digits, not its own: the body is there for its cost, never for its output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfence.kv.pool import KVPool
from kvfence.model.attention import AttentionBackend, begin_step, gather, get_backend, token_rows
from kvfence.model.base import CausalLM, ForwardBatch
from kvfence.model.config import ModelConfig

_DIGITS = 3
_BASE = 256
MIRROR_LOGIT = 100.0  # all the mass on the echoed id, even sampled at high temperature


def encode_ids(ids: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[T] ids -> [T, kv_heads, head_dim] with the id's base-256 digits in the first channels."""
    out = torch.zeros((ids.numel(), num_kv_heads, head_dim), dtype=torch.float32)
    rest = ids.to(torch.int64)
    for d in reversed(range(_DIGITS)):
        out[:, :, d] = (rest % _BASE).float()[:, None]
        rest = rest // _BASE
    return out


def decode_ids(kv: torch.Tensor) -> torch.Tensor:
    """[..., kv_heads, head_dim] -> [...] ids, from the first KV head's digits."""
    digits = kv[..., 0, :_DIGITS].float().round().to(torch.int64)
    ids = torch.zeros(digits.shape[:-1], dtype=torch.int64)
    for d in range(_DIGITS):
        ids = ids * _BASE + digits[..., d]
    return ids


def _prefills(batch: ForwardBatch) -> bool:
    """Some row still reads prompt tokens (none generated yet): the step signal 3 times."""
    return bool((batch.num_generated == 0).any())


class MirrorModel(CausalLM):
    """Same interfaces as `LlamaModel`; no weights, so `from_config` is all it needs."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        backend: AttentionBackend | None = None,
        body: CausalLM | None = None,
    ) -> None:
        super().__init__()
        if config.head_dim < _DIGITS:
            raise ValueError(f"the mirror model needs head_dim >= {_DIGITS}")
        self.config = config
        self.backend = backend or get_backend("cpu")
        self.body = body

    @classmethod
    def from_config(cls, config: ModelConfig) -> MirrorModel:
        return cls(config)

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        return self.forward_many([(batch, pool)])[0]

    def forward_many(self, parts: Sequence[tuple[ForwardBatch, KVPool]]) -> list[torch.Tensor]:
        if self.body is not None and any(_prefills(batch) for batch, _ in parts):
            self.body.forward_many(parts)  # the real cost, one body pass; its output is not used
        with torch.inference_mode():
            for batch, pool in parts:
                begin_step(pool, batch)  # I1 for every part before any write, as the real model
            return [self._echo(batch, pool) for batch, pool in parts]

    def _echo(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        with torch.inference_mode():
            kv = encode_ids(batch.input_ids, pool.geometry.num_kv_heads, pool.geometry.head_dim)
            for layer in range(pool.geometry.num_layers):
                self.backend.write(pool, layer, batch.slot_mapping, kv, kv)
            keys, _ = gather(pool, 0, batch.pages)  # [B, M*page_size, kv_heads, head_dim]
            stored = decode_ids(keys)  # [B, M*page_size]
            last = batch.query_starts[1:] - 1
            if batch.all_logits:
                rows = token_rows(batch)
                # Token t predicts what sits num_generated positions back from its row's last token's view.
                back = batch.positions[last][rows] - batch.positions
                target = batch.num_generated[rows] - back
            else:
                rows = torch.arange(batch.num_rows)
                target = batch.num_generated.clone()
            limit = torch.minimum(batch.pages.lengths[rows], torch.tensor(stored.shape[1])) - 1
            target = torch.minimum(target.clamp(min=0), limit.clamp(min=0))
            echoed = stored[rows, target].clamp(0, self.config.vocab_size - 1)
            logits = torch.zeros((rows.numel(), self.config.vocab_size), dtype=torch.float32)
            logits[torch.arange(rows.numel()), echoed] = MIRROR_LOGIT
            return logits
