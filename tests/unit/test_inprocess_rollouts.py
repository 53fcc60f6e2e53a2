"""Mode colocate's rollouts: an environment in the trainer's process sampling from the engine.
The engine here is a fake that records its calls (the e2e test runs the real one)."""

from types import SimpleNamespace

import numpy as np
import pytest

from api.validation import check_shape
from example_trainer.data.inprocess_rollouts import InProcessRollouts, load_environment
from example_trainer.model.routing_replay import decode_routes


class FakeEngine:
    """Answers every prompt with the completions "\\boxed{<n>}" for n = 0, 1, ...: one call, many prompts.
    ``routes``: each completion n comes with vLLM's routed experts, expert n at every position of one layer."""

    def __init__(self, tokenizer, routes=False):
        self.tokenizer, self.calls, self.routes = tokenizer, [], routes

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        outputs = []
        for prompt, p in zip(prompts, params):
            choices = []
            for i in range(p.n):
                ids = self.tokenizer.encode(f"\\boxed{{{i}}}", add_special_tokens=False)
                routes = np.full((len(prompt) + len(ids) - 1, 1, 1), i, np.uint8) if self.routes else None
                choices.append(SimpleNamespace(token_ids=ids, text=None, finish_reason="stop", routed_experts=routes,
                                               logprobs=[{t: SimpleNamespace(logprob=-0.25)} for t in ids]))
            outputs.append(SimpleNamespace(prompt_token_ids=prompt, outputs=choices))
        return outputs


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    from example_trainer.model.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def test_a_steps_groups_are_sampled_in_one_engine_call_and_keep_the_api_shape(tokenizer):
    engine = FakeEngine(tokenizer)
    env = load_environment("arithmetic", "--env.group_size 4 --env.max_tokens 32 --env.difficulty 1 --env.operations + "
                           "--env.ensure_scores_are_not_same false", 256, tokenizer, engine)
    batch = InProcessRollouts(env, batch_size=12).get_batch(timeout=60)
    assert engine.calls == [3]  # three groups, one generate
    assert len(batch) == 3 and all(len(g.tokens) == 4 for g in batch)
    group = batch[0]
    completion = tokenizer.encode("\\boxed{1}", add_special_tokens=False)
    assert group.tokens[1][-len(completion):] == completion
    assert group.inference_logprobs[1][-len(completion):] == [-0.25] * len(completion)
    assert group.masks[1][:-len(completion)] == [-100] * (len(group.tokens[1]) - len(completion))
    assert group.routed_experts is None  # vLLM without --enable-return-routed-experts


def test_vllms_routes_reach_the_batch_in_the_apis_shape(tokenizer):
    env = load_environment("arithmetic", "--env.group_size 2 --env.max_tokens 32 --env.difficulty 1 --env.operations + "
                           "--env.ensure_scores_are_not_same false", 256, tokenizer, FakeEngine(tokenizer, routes=True))
    group = InProcessRollouts(env, batch_size=2).get_batch(timeout=60)[0]
    check_shape(group)  # one position per token but the last
    assert [decode_routes(r).unique().tolist() for r in group.routed_experts] == [[0], [1]]


def test_groups_the_environment_rejects_are_sampled_again(tokenizer):
    engine = FakeEngine(tokenizer)  # every completion wrong for 1-digit sums above 3: equal scores, dropped
    env = load_environment("arithmetic", "--env.group_size 2 --env.max_tokens 32 --env.difficulty 1 --env.operations * --env.seed 1", 256, tokenizer, engine)
    batch = InProcessRollouts(env, batch_size=2).get_batch(timeout=60)
    assert len(batch) == 1 and len(set(batch[0].scores)) == 2
    assert len(engine.calls) == env.counts["dropped_equal_scores"] + 1


def test_a_batch_is_whole_groups_and_the_environment_must_exist(tokenizer):
    env = load_environment("arithmetic", "--env.group_size 4 --env.max_tokens 32", 256, tokenizer, FakeEngine(tokenizer))
    with pytest.raises(ValueError, match="--batch-size 6 is not a multiple of the environment's group size 4"):
        InProcessRollouts(env, batch_size=6)
    with pytest.raises(ModuleNotFoundError):
        load_environment("nonexistent", "", 256, tokenizer, FakeEngine(tokenizer))


def test_an_environment_is_named_by_its_short_name_or_its_module_path(tokenizer):
    """A dotted name is the module itself (an environment outside environments/, as the launcher
    runs tests/e2e/forced_mcp_env.py); a bare one is environments/<name>_server.py."""
    by_name = load_environment("arithmetic", "--env.group_size 2 --env.max_tokens 32", 256, tokenizer, FakeEngine(tokenizer))
    by_path = load_environment("environments.arithmetic_server", "--env.group_size 2 --env.max_tokens 32", 256, tokenizer,
                               FakeEngine(tokenizer))
    assert type(by_path) is type(by_name) and by_path.config.group_size == 2
    with pytest.raises(ValueError, match="environments.config must define one BaseEnv subclass, found 0"):
        load_environment("environments.config", "", 256, tokenizer, FakeEngine(tokenizer))


@pytest.mark.parametrize("flags, message", [
    ({"weight_bridge_mode": "shared_vllm", "env_args": "--env.group_size 8"}, "are for --weight-bridge-mode colocate"),
    ({"weight_bridge_mode": "none", "release_kv_cache": True}, "are for --weight-bridge-mode colocate"),
    ({"weight_bridge_mode": "colocate", "launch_vllm": False}, "builds vLLM in this process"),
])
def test_colocate_flags_are_refused_where_they_would_be_ignored(flags, message):
    from example_trainer.config import TrainerConfig

    with pytest.raises(ValueError, match=message):
        TrainerConfig(**flags)


def test_releasing_the_kv_cache_is_refused_on_cpu_before_the_engine_starts(tmp_path, default_model):
    import torch

    from example_trainer.bridges import bridge_class
    from example_trainer.bridges.attach import AttachError
    from example_trainer.bridges.inprocess_engine import InProcessEngine
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import launch_inference

    cfg = TrainerConfig(weight_bridge_mode="colocate", release_kv_cache=True)
    engine = launch_inference(cfg, tmp_path, bridge_class(cfg.weight_bridge_mode))
    assert isinstance(engine, InProcessEngine) and "--enable-cumem-allocator" in engine.args
    bridge = bridge_class("colocate")(cfg, default_model, tmp_path, torch.device("cpu"), engine)
    with pytest.raises(AttachError, match="--release-kv-cache needs a GPU"):
        bridge.serve_on()
