"""reasoning-gym's tasks through ReasoningGymEnv against a fake /generate (skipped without the
optional extra: pip install --no-deps -r requirements-reasoning-gym.txt)."""

import asyncio
import json

import pytest
from env_fakes import FAST, FakeInference, FakeServer

from environments.config import ConfigError, ServerConfig

reasoning_gym = pytest.importorskip("reasoning_gym")

from environments.reasoning_gym_server import ReasoningGymEnv, ReasoningGymEnvConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class AnswersTasks(FakeInference):
    """Answers each prompt's reasoning-gym question: right for even choices, wrong for odd."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        super().__init__(tokenizer)
        self.answers = answers

    def _text(self, prompt_ids, i) -> str:
        prompt = self.tokenizer.decode(prompt_ids)
        answer = next(a for q, a in self.answers.items() if q in prompt)
        return f"Thinking.\n<answer>{answer if i % 2 == 0 else 'no idea'}</answer>"


def make_env(tokenizer, url, **settings):
    config = ReasoningGymEnvConfig(**{"group_size": 4, "max_token_length": 2048, "max_tokens": 64,
                                      "tokenizer_name": "unused", "seed": 5, "num_eval_items": 8, **settings})
    env = ReasoningGymEnv(config, ServerConfig(base_url=url, timeout=5.0), tokenizer=tokenizer)
    env.backoff = FAST
    return env


def run_env(env, body):
    async def go():
        env.open_clients()
        try:
            await env.setup()
            return await body(env)
        finally:
            await env.close_clients()

    return asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize("task, settings", [("basic_arithmetic", {}), ("chain_sum", {"min_terms": 2, "max_terms": 3})])
def test_a_task_gives_groups_scored_by_its_own_score_answer(tokenizer, task, settings):
    reference = reasoning_gym.create_dataset(task, seed=5, size=50, **settings)
    answers = {reference[i]["question"]: reference[i]["answer"] for i in range(len(reference))}
    inference = AnswersTasks(tokenizer, answers)
    server = FakeServer(inference).start()
    try:
        env = make_env(tokenizer, server.url, task=task, task_config=json.dumps(settings))
        item, group = run_env(env, lambda env: one_group(env))
    finally:
        server.stop()
    assert item["question"] in answers and item["metadata"]["source_dataset"] == task
    assert group.scores == [1.0, 0.0, 1.0, 0.0]  # the task's own check of the text in <answer> tags
    assert reference.score_answer(item["answer"], entry=item) == 1.0
    prompt = tokenizer.decode(inference.requests[0]["prompt_token_ids"])
    assert "<answer>answer here</answer>" in prompt and item["question"] in prompt  # reasoning-gym's prompt


async def one_group(env):
    item = await env.get_next_item()
    group, _ = await env.collect_trajectories(item)
    return item, group


def test_eval_entries_come_from_eval_seed_and_are_kept_out_of_training(tokenizer):
    env = make_env(tokenizer, "http://127.0.0.1:9", task="basic_arithmetic", num_eval_items=16)

    async def items(env):
        return [await env.get_next_item() for _ in range(200)]

    training = run_env(env, items)
    evaluation = reasoning_gym.create_dataset("basic_arithmetic", seed=env.config.eval_seed, size=16)
    held_out = {evaluation[i]["question"] for i in range(16)}
    assert [item["question"] for item in env.eval_items] == [evaluation[i]["question"] for i in range(16)]
    assert not held_out & {item["question"] for item in training}


def test_bad_settings_name_the_flag():
    with pytest.raises(ConfigError, match="task_config"):
        ReasoningGymEnvConfig(task_config="[1, 2]")
    with pytest.raises(ConfigError, match="eval_seed"):
        ReasoningGymEnvConfig(seed=3, eval_seed=3)


def test_an_unknown_task_lists_the_valid_ones(tokenizer):
    env = make_env(tokenizer, "http://127.0.0.1:9", task="no_such_task")
    with pytest.raises(ConfigError, match="not a reasoning-gym task; valid: .*basic_arithmetic"):
        run_env(env, lambda env: asyncio.sleep(0))


def test_eval_accuracy_counts_full_scores_only_where_a_task_gives_partial_credit(tokenizer):
    """fraction_simplification pays 0.01 for any wrong fraction: as "any score above 0" every
    item counted as solved (accuracy 1.0 here); only the right half may."""
    evaluation = reasoning_gym.create_dataset("fraction_simplification", seed=1_000_003, size=8)
    entries = [evaluation[i] for i in range(8)]
    answers = {e["question"]: e["answer"] if k % 2 == 0 else "1/7919" for k, e in enumerate(entries)}
    assert evaluation.score_answer("1/7919", entry=entries[1]) > 0  # partial credit for a wrong answer
    server = FakeServer(AnswersTasks(tokenizer, answers)).start()
    try:
        env = make_env(tokenizer, server.url, task="fraction_simplification", eval_seed=1_000_003)
        metrics = run_env(env, lambda env: env.evaluate())
    finally:
        server.stop()
    assert metrics == {"env/eval_accuracy": 0.5, "env/eval_items": 8.0}


class AnswersTheLastQuestion(AnswersTasks):
    """AnswersTasks for prompts with shots: the question asked is the one nearest the end."""

    def _text(self, prompt_ids, i) -> str:
        prompt = self.tokenizer.decode(prompt_ids)
        answer = self.answers[max((q for q in self.answers if q in prompt), key=prompt.rindex)]
        return f"<answer>{answer if i % 2 == 0 else 'no idea'}</answer>"


def test_shots_put_solved_entries_of_the_task_before_every_question(tokenizer):
    entries = [d[i] for seed in (5, 1_000_001)
               for d in [reasoning_gym.create_dataset("basic_arithmetic", seed=seed, size=50)] for i in range(50)]
    inference = AnswersTheLastQuestion(tokenizer, {e["question"]: e["answer"] for e in entries})
    server = FakeServer(inference).start()
    try:
        env = make_env(tokenizer, server.url, task="basic_arithmetic", shots=2, num_eval_items=2)
        item, group = run_env(env, lambda env: one_group(env))
        run_env(env, lambda env: env.evaluate())
    finally:
        server.stop()
    shots = reasoning_gym.create_dataset("basic_arithmetic", seed=env.config.eval_seed - 2, size=2)
    assert not {shots[0]["question"], shots[1]["question"]} & {e["question"] for e in env.eval_items}
    messages = env.build_messages(item)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages[1:5]] == [shots[0]["question"], f"<answer>{shots[0]['answer']}</answer>",
                                                     shots[1]["question"], f"<answer>{shots[1]['answer']}</answer>"]
    prompts = [tokenizer.decode(body["prompt_token_ids"]) for body in inference.requests]
    asked = [item["question"]] + [e["question"] for e in env.eval_items]
    assert len(prompts) == 3  # the training group's call, then one per eval item (in any order)
    for prompt in prompts:
        question = next(q for q in asked if q in prompt)
        assert prompt.index(shots[0]["question"]) < prompt.index(f"<answer>{shots[1]['answer']}</answer>") \
            < prompt.index(question)
    assert {next(q for q in asked if q in prompt) for prompt in prompts} == set(asked)
    assert group.scores == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="shots"):
        ReasoningGymEnvConfig(shots=-1)
