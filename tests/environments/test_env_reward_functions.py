"""TRL-style reward functions as an environment (environments/reward_functions.py)."""

import asyncio

import pytest

from environments.arithmetic_rewards_server import ArithmeticRewardsEnv
from environments.config import BaseEnvConfig, ServerConfig
from environments.reward_functions import RewardFunctionEnv


def make(env_cls, inference_url, tokenizer):
    config = BaseEnvConfig(group_size=4, max_token_length=256, max_tokens=32, tokenizer_name="unused", seed=3)
    return env_cls(config, ServerConfig(base_url=inference_url, timeout=5.0), tokenizer=tokenizer)


async def one_group(env):
    await env.setup()
    env.open_clients()
    try:
        item = await env.get_next_item()
        group, _ = await env.collect_trajectories(item)
        return item, group
    finally:
        await env.close_clients()


def test_arithmetic_rewards_sum_the_answer_and_the_format(fake_inference, tokenizer):
    fake_inference.answer_arithmetic = True  # even choices right, odd ones off by one, all boxed
    item, group = asyncio.run(one_group(make(ArithmeticRewardsEnv, fake_inference.server.url, tokenizer)))
    assert group.scores == pytest.approx([1.1, 0.1, 1.1, 0.1])
    assert item["prompt"].startswith("What is ") and "answer" in item
    assert group.messages[0][0]["role"] == "system"  # the environment's system prompt, then the row's prompt


def test_chat_prompts_columns_weights_and_none_reach_the_functions_as_in_trl(fake_inference, tokenizer):
    seen = {}

    def length(prompts, completions, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, level=level, extra=sorted(kwargs))
        return [len(c[0]["content"]) for c in completions]

    def not_applicable(prompts, completions, **kwargs):
        return [None, 1.0, None, 1.0]

    class ChatEnv(RewardFunctionEnv):
        reward_funcs = (length, not_applicable)
        reward_weights = (0.5, 10.0)

        def rows(self):
            return [{"prompt": [{"role": "user", "content": "hi"}], "level": 2, "tag": "x"}]

    fake_inference.texts = ["ab", "abcd", "a", ""]
    _, group = asyncio.run(one_group(make(ChatEnv, fake_inference.server.url, tokenizer)))
    assert group.scores == pytest.approx([1.0, 12.0, 0.5, 10.0])
    assert seen["prompts"] == [[{"role": "user", "content": "hi"}]] * 4
    assert seen["completions"][1] == [{"role": "assistant", "content": "abcd"}]
    assert seen["level"] == [2, 2, 2, 2] and seen["extra"] == ["tag"]


def test_a_reward_function_with_the_wrong_count_is_named(fake_inference, tokenizer):
    def short(prompts, completions, **kwargs):
        return [1.0]

    class ShortEnv(RewardFunctionEnv):
        reward_funcs = (short,)

        def rows(self):
            return [{"prompt": "q"}]

    with pytest.raises(ValueError, match="reward function short returned 1 values for 4 completions"):
        asyncio.run(one_group(make(ShortEnv, fake_inference.server.url, tokenizer)))


def test_rows_without_a_prompt_are_refused(tokenizer):
    class NoPrompt(RewardFunctionEnv):
        reward_funcs = (lambda prompts, completions, **kw: [0.0] * len(completions),)

        def rows(self):
            return [{"question": "q"}]

    with pytest.raises(ValueError, match="must return dicts that each have a 'prompt'"):
        asyncio.run(make(NoPrompt, "http://127.0.0.1:9", tokenizer).setup())
