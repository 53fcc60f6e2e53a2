"""Checkpoint pruning and the trainer's defaults."""


def test_pruning_keeps_the_newest_the_newest_resumable_and_the_one_vllm_serves(tmp_path):
    from example_trainer.model.checkpoint import TRAINER_STATE, prune_checkpoints

    for step in (1, 2, 3, 4, 5, 6):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_2" / TRAINER_STATE).write_bytes(b"")  # the newest resumable one
    removed = prune_checkpoints(tmp_path, save_total_limit=2, in_use=[tmp_path / "checkpoints" / "step_4"])
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_2", "step_4", "step_5", "step_6"] and len(removed) == 2
    assert prune_checkpoints(tmp_path, save_total_limit=0) == []  # 0 keeps all


def test_the_default_mode_is_single_copy_and_restart_modes_restart_every_few_steps():
    from environments.config_flags import parse_config
    from example_trainer.config import TrainerConfig

    cfg = parse_config(TrainerConfig, [])
    assert cfg.weight_bridge_mode == "shared_vllm" and cfg.vllm_restart_interval > 1 and cfg.save_total_limit == 2


def test_save_only_model_writes_the_weights_without_the_trainer_state(tmp_path):
    import torch
    from types import SimpleNamespace

    from example_trainer.grpo import save_checkpoint
    from example_trainer.model.checkpoint import TRAINER_STATE, latest_checkpoint
    from example_trainer.parallel import Parallel

    def save_weights(model, tokenizer, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        return folder

    weight = torch.nn.Parameter(torch.zeros(2))
    run = SimpleNamespace(parallel=Parallel(), model=None, tokenizer=None, optimizer=torch.optim.SGD([weight], lr=0.1),
                          bridge=SimpleNamespace(save_checkpoint=save_weights, masters=None))
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


class StartedServer:
    """The loop's vLLM server as a bridge sees it: started on a model folder, which a restart loads again."""

    def __init__(self) -> None:
        self.model: str | None = None

    def start(self, model: str, extra_args=None, env=None, wait: bool = True) -> float:
        self.model = model
        return 0.0

    @property
    def restarts_from(self) -> str | None:
        return self.model


def test_an_in_process_engine_protects_no_folder_from_pruning(default_model):
    """Colocate's engine is never restarted, and its ``model`` is a method (the loop crashed on
    Path(method) at its first prune)."""
    import torch

    from example_trainer.bridges.colocate import ColocateBridge
    from example_trainer.bridges.inprocess_engine import InProcessEngine
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import folders_in_use

    engine = InProcessEngine.__new__(InProcessEngine)  # not started: what the bridge reads of it is its class's
    bridge = ColocateBridge(TrainerConfig(weight_bridge_mode="colocate"), default_model, ".", torch.device("cpu"),
                            server=engine)
    assert folders_in_use(bridge.server) == []


def test_a_resumed_shared_vllm_run_keeps_the_checkpoint_a_vllm_restart_loads(tmp_path):
    """--resume starts vLLM on the checkpoint resumed from; a crashed vLLM restarts on that folder
    (SharedVllmBridge._recover), so pruning must keep it, however many newer checkpoints exist."""
    import json

    import torch

    from example_trainer.bridges.shared_vllm import SharedVllmBridge
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import folders_in_use
    from example_trainer.model.checkpoint import TRAINER_STATE, latest_checkpoint, prune_checkpoints

    def checkpoint(step: int):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / TRAINER_STATE).write_bytes(b"state")
        return folder

    checkpoint(1)
    resumed_from = checkpoint(2)
    cfg = TrainerConfig(weight_bridge_mode="shared_vllm", resume=True, save_total_limit=1)
    model_path = str(latest_checkpoint(tmp_path))  # what the loop starts from on --resume
    bridge = SharedVllmBridge(cfg, model_path, tmp_path, torch.device("cpu"), server=StartedServer())
    bridge.server.start(*bridge.serve_on())  # as the loop's prepare() starts vLLM
    for step in (3, 4, 5):  # the resumed run goes on and saves newer checkpoints, pruning as the loop does
        checkpoint(step)
        prune_checkpoints(tmp_path, cfg.save_total_limit, in_use=folders_in_use(bridge.server))
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_2", "step_5"], f"the folder a vLLM restart loads ({resumed_from.name}) was pruned: {left}"
    assert (resumed_from / "model.safetensors").read_bytes() == b"weights" and bridge.model_path == str(resumed_from)
