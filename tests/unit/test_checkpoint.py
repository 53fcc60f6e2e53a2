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
