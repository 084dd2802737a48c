"""The tiny Llama checkpoint behind the server: sampling controls reach the engine intact."""

from __future__ import annotations

import math

from serve_helpers import IDLE, Served


def test_greedy_is_deterministic_and_streaming_equals_non_streaming(llama: Served) -> None:
    kw = {"model": llama.model, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    a = llama.client("a").completions.create(extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    b = llama.client("b").completions.create(extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text
    chunks = list(
        llama.client("c").completions.create(stream=True, extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert a.usage is not None and a.usage.completion_tokens == 12


def test_seed_reproduces_a_sampled_answer(llama: Served) -> None:
    def sample(seed: int) -> str:
        r = llama.client().completions.create(
            model=llama.model,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            extra_body={"top_k": 50, "ignore_eos": True},
        )
        return r.choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in range(4)}) > 1  # the seed matters


def test_chat_and_logprobs_on_the_real_model(llama: Served) -> None:
    r = llama.client().chat.completions.create(
        model=llama.model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and r.usage is not None
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob >= tops[-1] - 1e-6  # greedy picks from the top
    assert llama.wait_idle() == IDLE
