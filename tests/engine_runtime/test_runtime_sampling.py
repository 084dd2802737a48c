"""Sampling: greedy, temperature, top-k, top-p, seeds reproducible across batch compositions."""

from __future__ import annotations

import torch
from runtime_helpers import Models, run, work

from kvfence.engine.messages import SamplingParams
from kvfence.engine.sampling import Sampler, SampleRow, stop_reason


def logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_and_degenerate_filters_take_the_argmax() -> None:
    x = logits(6)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ] * 2
    out = Sampler(seed=1).sample(x, [SampleRow(p, 0) for p in params])
    assert out.tokens == x.argmax(-1).tolist()


def test_seeded_draw_does_not_depend_on_the_batch() -> None:
    x = logits(5)
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler().sample(x[2:3], [SampleRow(target, i)]).tokens[0] for i in range(20)]
    others = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
    ]
    for i in range(20):
        rows = [
            SampleRow(others[0], i),
            SampleRow(others[1], i),
            SampleRow(target, i),
            SampleRow(others[2], i),
            SampleRow(target, 99),
        ]
        assert Sampler().sample(x, rows).tokens[2] == alone[i]
    assert len(set(alone)) > 1  # the draws do vary with the token index


def test_top_k_and_top_p_keep_only_allowed_tokens() -> None:
    x = logits(1, vocab=32)
    top4 = set(x[0].topk(4).indices.tolist())
    s = Sampler(seed=3)
    k_draws = {s.sample(x, [SampleRow(SamplingParams(top_k=4), i)]).tokens[0] for i in range(300)}
    assert k_draws <= top4 and len(k_draws) > 1
    probs = x[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    p_draws = {s.sample(x, [SampleRow(SamplingParams(top_p=0.5), i)]).tokens[0] for i in range(300)}
    assert p_draws <= nucleus


def test_temperature_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(seed=5)
    counts = torch.zeros(4)
    for _ in range(1500):
        counts[s.sample(x, [SampleRow(SamplingParams(temperature=1.0), 0)]).tokens[0]] += 1
    assert torch.allclose(counts / 1500, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.05)


def test_stop_reason() -> None:
    p = SamplingParams(max_tokens=3, stop_token_ids=(7,))
    eos = frozenset({2})
    assert stop_reason(7, 1, p, eos) == "stop"
    assert stop_reason(2, 1, p, eos) == "stop"
    assert stop_reason(2, 1, SamplingParams(max_tokens=3, ignore_eos=True), eos) is None
    assert stop_reason(5, 3, p, eos) == "length"
    assert stop_reason(5, 2, p, eos) is None


def test_seeded_request_is_reproducible_across_batch_compositions(models: Models) -> None:
    prompt = list(range(20, 70))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    pipe = models.pipeline("llama")
    (alone,) = run(pipe, [work("x", "t", prompt, seeded)])
    crowd = [
        work(
            f"o{i}",
            "u",
            list(range(5 + i, 40 + 9 * i)),
            SamplingParams(max_tokens=9, temperature=0.9),
        )
        for i in range(3)
    ]
    results = run(pipe, [*crowd[:2], work("x2", "t", prompt, seeded), crowd[2]])
    assert results[2].token_ids == alone.token_ids
    (other_seed,) = run(
        pipe, [work("x3", "t", prompt, SamplingParams(max_tokens=12, seed=78, ignore_eos=True))]
    )
    assert other_seed.token_ids != alone.token_ids
