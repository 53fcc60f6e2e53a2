"""Checkpoint pruning and the trainer's defaults."""


def test_pruning_keeps_the_newest_the_newest_resumable_and_the_one_vllm_serves(tmp_path):
    from example_trainer.checkpoint import TRAINER_STATE, prune_checkpoints

    for step in (1, 2, 3, 4, 5, 6):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_2" / TRAINER_STATE).write_bytes(b"")  # the newest resumable one
    removed = prune_checkpoints(tmp_path, keep_last=2, in_use=[tmp_path / "checkpoints" / "step_4"])
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_2", "step_4", "step_5", "step_6"] and len(removed) == 2
    assert prune_checkpoints(tmp_path, keep_last=0) == []  # 0 keeps all


def test_the_default_mode_is_single_copy_and_restart_modes_restart_every_few_steps():
    from environments.config_flags import parse_config
    from example_trainer.config import TrainerConfig

    cfg = parse_config(TrainerConfig, [])
    assert cfg.weight_bridge_mode == "shared_vllm" and cfg.vllm_restart_interval > 1 and cfg.keep_last == 2


def test_save_only_model_writes_the_weights_without_the_trainer_state(tmp_path):
    import torch
    from types import SimpleNamespace

    from example_trainer.checkpoint import TRAINER_STATE, latest_checkpoint
    from example_trainer.grpo import save_checkpoint
    from example_trainer.parallel import Parallel

    def save_weights(model, tokenizer, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        return folder

    weight = torch.nn.Parameter(torch.zeros(2))
    run = SimpleNamespace(parallel=Parallel(), model=None, tokenizer=None, optimizer=torch.optim.SGD([weight], lr=0.1),
                          bridge=SimpleNamespace(save_checkpoint=save_weights, trainer_state=dict))
    save_checkpoint(run, tmp_path / "checkpoints" / "step_1", 1)
    save_checkpoint(run, tmp_path / "checkpoints" / "step_2", 2, resumable=False)
    assert (tmp_path / "checkpoints" / "step_1" / TRAINER_STATE).exists()
    assert not (tmp_path / "checkpoints" / "step_2" / TRAINER_STATE).exists()
    assert (tmp_path / "checkpoints" / "step_2" / "model.safetensors").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"  # --resume skips weights-only ones
    # A weights-only save into a folder an earlier run left resumable takes that run's state away:
    # --resume must not pair these weights with the old masters and step.
    reused = tmp_path / "checkpoints" / "step_1"
    save_checkpoint(run, reused, 1, resumable=False)
    assert not (reused / TRAINER_STATE).exists() and latest_checkpoint(tmp_path) is None
