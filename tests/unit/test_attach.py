"""Single-copy attach without vLLM: a fake exporter lays out a tiny model the way vLLM does
(fused qkv / gate_up, padded vocab) in CPU shared memory, and the trainer attaches to it."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from example_trainer.bridges.attach import AttachError, attach_model, find_bridge_file, load_bridge
from vllm_patching.bridge_file import BRIDGE_FILENAME, BridgeFile, read_bridge_file, write_bridge_file
from vllm_patching.export import export_parameters, move_to_shared_memory

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def vllm_layout(hf: torch.nn.Module, cfg, tp_size: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """HF weights fused and padded as vLLM 0.26 holds them for Llama/Qwen2; with ``tp_size`` > 1,
    the shards its tensor-parallel worker ``rank`` holds (output rows of q/k/v and gate/up, input
    columns of o/down, rows of the padded vocabulary)."""
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    rows = lambda t: t.chunk(tp_size)[rank].clone()  # noqa: E731
    cols = lambda t: t.chunk(tp_size, dim=1)[rank].clone()  # noqa: E731
    pad = lambda t: torch.cat([t, torch.zeros(-t.shape[0] % 64, *t.shape[1:], dtype=t.dtype)])  # noqa: E731
    out = {"model.embed_tokens.weight": rows(pad(sd["model.embed_tokens.weight"])), "model.norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = rows(pad(sd["lm_head.weight"]))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [sd.get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
            if parts[0] is not None:
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([rows(t) for t in parts])
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([rows(sd[f"{p}mlp.gate_proj.weight"]), rows(sd[f"{p}mlp.up_proj.weight"])])
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            out[p + name] = cols(sd[p + name])
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + name] = sd[p + name]
    return out


class FakeExporter:
    """Holds vLLM-layout tensors in shared memory and writes a bridge file, as the worker does."""

    def __init__(self, tmp_path, config_cls, gate=None, **overrides):
        torch.manual_seed(0)
        self.cfg = config_cls(**{**TINY, **overrides})
        self.cfg.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
        self.hf = AutoModelForCausalLM.from_config(self.cfg, dtype=torch.bfloat16)
        self.model_path = str(tmp_path / "model")
        self.hf.save_pretrained(self.model_path)
        self.tensors = vllm_layout(self.hf, self.cfg)
        module = torch.nn.Module()
        for name, t in self.tensors.items():
            module.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t, requires_grad=False))
        move_to_shared_memory(module)
        self.shared = {n.replace("__", "."): p.data for n, p in module.named_parameters()}
        handles, mappings, transport = export_parameters(self.shared.items())
        self.bridge = BridgeFile(model=self.model_path, architecture=self.cfg.architectures[0], vllm_version="fake",
                                 transport=transport, exporter_pid=os.getpid(), created_at=time.time(),
                                 export_id=gate.export_id if gate else "",
                                 num_params=len(handles), param_names=list(handles), param_mappings=mappings,
                                 ipc_handles=handles, gate=gate)
        self.path = write_bridge_file(tmp_path / "logs", self.bridge)


def bridge_on_a_fake_export(tmp_path, monkeypatch, device: str = "cpu", gate_folder=None, **flags):
    """A shared_vllm bridge (--launch-vllm false, ``flags``; the trainer on ``device``) for a fake
    vLLM-cpu export with a weights gate in ``gate_folder`` (default ``tmp_path/shm``), not yet
    attached: (the worker's gate, the fake export, the bridge). No vLLM server here to confirm that
    it serves this export (the integration tests check that)."""
    from example_trainer.bridges.shared_vllm import SharedVllmBridge
    from example_trainer.config import TrainerConfig
    from vllm_patching.gate import WorkerGate

    worker_gate = WorkerGate("e" * 32, torch.device("cpu"), directory=gate_folder or tmp_path / "shm")
    fake = FakeExporter(tmp_path, LlamaConfig, gate=worker_gate.info())
    monkeypatch.setattr(SharedVllmBridge, "_check_server_serves", lambda self, bridge: None)
    cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_config_path=str(fake.path), **flags)
    return worker_gate, fake, SharedVllmBridge(cfg, fake.model_path, tmp_path, torch.device(device))


@pytest.mark.parametrize("config_cls, tied", [(LlamaConfig, True), (Qwen2Config, False)])
def test_attached_model_computes_what_the_original_computes(tmp_path, config_cls, tied):
    fake = FakeExporter(tmp_path, config_cls, tie_word_embeddings=tied)
    model, _ = attach_model(load_bridge(fake.path, fake.model_path), fake.model_path)
    ids = torch.tensor([[1, 5, 9, 42, 77, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fake.hf(ids).logits)


def test_writes_through_the_attached_model_land_in_the_exported_memory(tmp_path):
    fake = FakeExporter(tmp_path, Qwen2Config, tie_word_embeddings=False)
    model, _ = attach_model(load_bridge(fake.path, fake.model_path), fake.model_path)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.bias.fill_(3.0)
        model.model.layers[0].mlp.up_proj.weight.fill_(-2.0)
    qkv_bias = fake.shared["model.layers.1.self_attn.qkv_proj.bias"]  # rows: q 32, k 16, v 16
    assert (qkv_bias[32:48] == 3.0).all() and not (qkv_bias[:32] == 3.0).any() and not (qkv_bias[48:] == 3.0).any()
    gate_up = fake.shared["model.layers.0.mlp.gate_up_proj.weight"]
    assert (gate_up[64:] == -2.0).all() and not (gate_up[:64] == -2.0).any()


def test_tied_embedding_is_one_tensor(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig, tie_word_embeddings=True)
    model, _ = attach_model(load_bridge(fake.path, fake.model_path), fake.model_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.shape[0] == 100  # padded rows (128) are not part of the view


def test_rotary_buffers_use_the_models_rope_settings(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig, rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    model, _ = attach_model(load_bridge(fake.path, fake.model_path), fake.model_path)
    assert torch.allclose(model.model.rotary_emb.inv_freq, fake.hf.model.rotary_emb.inv_freq)


def test_attach_rejects_other_model(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig)
    with pytest.raises(AttachError, match="is for model"):
        load_bridge(fake.path, str(tmp_path / "some-other-model"))


def test_attach_rejects_stale_file_of_dead_exporter(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    raw = json.loads(fake.path.read_text())
    raw["exporter_pid"] = dead.pid
    fake.path.write_text(json.dumps(raw))
    with pytest.raises(AttachError, match="stale"):
        load_bridge(fake.path, fake.model_path)


def test_missing_file_lists_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOGDIR", str(tmp_path / "nowhere"))
    with pytest.raises(AttachError, match="VLLM_ENABLE_SHARED_WEIGHTS=1") as err:
        find_bridge_file(None)
    assert str(tmp_path / "nowhere" / BRIDGE_FILENAME) in str(err.value)


def test_explicit_path_wins(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig)
    assert find_bridge_file(str(fake.path)) == fake.path


def test_changed_shapes_are_rejected_with_the_parameter_name(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig)
    # The trainer's config says a wider MLP than what vLLM holds: a different model or layout.
    cfg_path = os.path.join(fake.model_path, "config.json")
    cfg = json.loads(open(cfg_path).read())
    cfg["intermediate_size"] = 48
    open(cfg_path, "w").write(json.dumps(cfg))
    with pytest.raises(AttachError, match=r"gate_proj.weight: the config implies 96 fused rows in vLLM's model.layers.0.mlp.gate_up_proj.weight, but it has 128"):
        attach_model(load_bridge(fake.path, fake.model_path), fake.model_path)


def test_missing_vllm_tensor_is_named(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig)
    raw = json.loads(fake.path.read_text())
    del raw["ipc_handles"]["model.layers.1.mlp.down_proj.weight"]
    fake.path.write_text(json.dumps(raw))
    with pytest.raises(AttachError, match="model.layers.1.mlp.down_proj.weight, which vLLM did not export"):
        attach_model(load_bridge(fake.path, fake.model_path), fake.model_path)


def test_bridge_file_is_private(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig)
    assert oct(fake.path.stat().st_mode & 0o777) == "0o600"


def test_each_tensor_parallel_rank_writes_its_own_bridge_file_and_rank_0_the_usual_one(tmp_path):
    fake = FakeExporter(tmp_path, LlamaConfig)
    for rank in (1, 0):
        path = write_bridge_file(tmp_path / "tp", fake.bridge.model_copy(update={"tp_degree": 2, "tp_rank": rank}))
        assert path.name == (BRIDGE_FILENAME if rank == 0 else "vllm_bridge_config.rank1.json")
        assert read_bridge_file(path).tp_rank == rank
    # A one-GPU trainer finds rank 0's file and is told the server is tensor-parallel.
    with pytest.raises(AttachError, match="tensor-parallel size 2"):
        load_bridge(find_bridge_file(None, str(tmp_path / "tp")), fake.model_path)


def test_unsupported_architecture_says_how_to_extend(tmp_path):
    from example_trainer.bridges.hf_mapping import map_hf_parameter

    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, Qwen2ForCausalLM.*--weight-bridge-mode none.*families.py"):
        map_hf_parameter("GPT2LMHeadModel", "transformer.wte.weight", LlamaConfig(**TINY))


def test_gradients_reach_the_exported_tensors_with_gradient_checkpointing(tmp_path):
    fake = FakeExporter(tmp_path, Qwen2Config, tie_word_embeddings=False)
    model, _ = attach_model(load_bridge(fake.path, fake.model_path), fake.model_path)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.tensor([[1, 5, 9, 42, 77, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_shared_bridge_refuses_a_file_without_weights_gate(tmp_path):
    from example_trainer.bridges.shared_vllm import SharedVllmBridge
    from example_trainer.config import TrainerConfig

    fake = FakeExporter(tmp_path, LlamaConfig)  # an older exporter: no gate in its file
    cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_config_path=str(fake.path))
    bridge = SharedVllmBridge(cfg, fake.model_path, tmp_path, torch.device("cpu"))
    with pytest.raises(AttachError, match="no weights gate"):
        bridge.attach()
    bridge.close()


def test_a_trainer_on_another_device_than_vllm_is_told_why_single_copy_cannot_work(tmp_path, monkeypatch):
    worker_gate, _, bridge = bridge_on_a_fake_export(tmp_path, monkeypatch, device="cuda")  # --device cuda
    with pytest.raises(AttachError, match="vLLM holds the weights on cpu and the trainer runs on cuda.*--device cpu"):
        bridge.attach()
    bridge.close()
    worker_gate.close()


def test_resume_writes_the_shared_weights_only_through_the_gate(tmp_path, monkeypatch):
    import threading

    worker_gate, fake, bridge = bridge_on_a_fake_export(tmp_path, monkeypatch,
                                                        gate_folder=tmp_path / "not-yet" / "shm")  # creates its folder
    bridge.attach()
    state = {"masters": bridge.masters.state()}  # what the loop saves in a resumable checkpoint
    state["masters"] = [torch.full_like(t, 0.5) for t in state["masters"]]
    resumed = threading.Event()
    resume = threading.Thread(target=lambda: (bridge.load_trainer_state(state), resumed.set()))
    worker_gate.begin_step()  # vLLM is running a step: the resume must wait for it
    resume.start()
    assert not resumed.wait(1.0), "the resume wrote vLLM's weights during a step"
    worker_gate.end_step()
    resume.join(10)
    assert resumed.is_set()
    norm = fake.shared["model.norm.weight"]
    assert torch.equal(norm, torch.full_like(norm, 0.5))  # written into the exported memory
    assert worker_gate.file.record.weights_version == 1 and not worker_gate.file.record.half_written
    bridge.close()
    bridge.close()  # safe twice
    worker_gate.close()


def test_bf16_inplace_steps_vllms_tensors_with_the_gate_closed_for_the_whole_step(tmp_path, monkeypatch):
    """The lean path: no fp32 masters; the optimizer (stochastic rounding) writes the shared bf16
    tensors itself, so the gate closes before optimizer.step() and opens after the sync."""
    from example_trainer.optim.optimizers import build_optimizer

    worker_gate, fake, bridge = bridge_on_a_fake_export(tmp_path, monkeypatch, bf16_inplace=True)
    model = bridge.attach()
    params = bridge.optimizer_parameters(model)
    assert bridge.masters is None and all(p.dtype == torch.bfloat16 for p in params)
    opt = build_optimizer("adamw", params, lr=1e-2, weight_decay=0.0)
    before = fake.shared["model.norm.weight"].clone()
    for p in params:
        p.grad = torch.ones_like(p)
    with bridge.writing(model):
        assert worker_gate.file.record.half_written  # vLLM starts no step from here on
        opt.step()
    metrics = bridge.sync(model, step=1, final=False)
    assert not worker_gate.file.record.half_written and worker_gate.file.record.weights_version == 1
    assert metrics["sync/gate_closed_seconds"] >= metrics["sync/write_seconds"] >= 0.0
    assert metrics["sync/gate_stalls"] == 0.0 and bridge.gate.timeout == bridge.cfg.gate_timeout  # --gate-timeout reached the gate
    assert (fake.shared["model.norm.weight"] < before).all()  # the step landed in the exported memory
    bridge.close()
    worker_gate.close()


def attached_to_a_worker_that_can_die(tmp_path, monkeypatch, **flags):
    """A bridge (--launch-vllm false, ``flags``) attached to a fake export whose worker is a process
    the test can kill: (that process, the worker's gate, the fake export, the bridge)."""
    import subprocess
    import sys

    exporter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # stands in for vLLM's worker
    worker_gate, fake, bridge = bridge_on_a_fake_export(tmp_path, monkeypatch, **flags)
    fake.bridge.exporter_pid = exporter.pid  # the bridge reads its file when it attaches
    write_bridge_file(tmp_path / "logs", fake.bridge)
    return exporter, worker_gate, fake, bridge


def test_a_lost_vllm_without_launch_stops_the_bridge_with_the_weights_kept(tmp_path, monkeypatch):
    from example_trainer.bridges.base import InferenceServerLost

    exporter, worker_gate, fake, bridge = attached_to_a_worker_that_can_die(tmp_path, monkeypatch)
    try:
        model = bridge.attach()
        with torch.no_grad():
            for master in bridge.masters.params:
                master.add_(0.25)  # the trainer's update, not yet written into vLLM
        exporter.kill()
        exporter.wait()
        norm_before = fake.shared["model.norm.weight"].clone()
        with pytest.raises(InferenceServerLost, match=f"pid {exporter.pid} .*exited.*--launch-vllm false.*--resume") as lost:
            bridge.sync(model, step=1, final=False)
        assert lost.value.weights_kept
        assert torch.equal(fake.shared["model.norm.weight"], norm_before)  # nothing written into the lost export
        for param, master in zip(model.parameters(), bridge.masters.params):  # the model holds the update
            assert param.device.type == "cpu" and torch.equal(param, master.to(param.dtype))
    finally:
        bridge.close()
        worker_gate.close()


def test_a_lost_vllm_with_bf16_inplace_says_the_weights_went_with_it_and_the_trainer_saves_none(tmp_path, monkeypatch):
    """The weights lived only in vLLM's memory: the trainer must not save its detached (meta) model
    as step N's checkpoint, and says where --resume continues from instead."""
    from types import SimpleNamespace

    from example_trainer.bridges.base import InferenceServerLost
    from example_trainer.grpo import keep_what_a_lost_server_left

    exporter, worker_gate, _, bridge = attached_to_a_worker_that_can_die(tmp_path, monkeypatch, bf16_inplace=True)
    try:
        model = bridge.attach()
        exporter.kill()
        exporter.wait()
        with pytest.raises(InferenceServerLost, match=f"pid {exporter.pid} .*exited") as lost:
            with bridge.writing(model):  # in place: the gate closes here, and finds vLLM gone
                pass
        assert not lost.value.weights_kept
        assert all(p.is_meta for p in model.parameters())  # nothing left to save
        run = SimpleNamespace(run_dir=tmp_path / "run", weights_step=3)
        message = keep_what_a_lost_server_left(run, lost.value)
        assert "step 3 are not saved: they lived only in vLLM's memory" in message and "no checkpoint was saved yet" in message
        assert not (tmp_path / "run" / "checkpoints").exists()
    finally:
        bridge.close()
        worker_gate.close()


def test_a_vllm_worker_that_dies_while_bf16_inplace_waits_at_the_gate_stops_the_trainer_with_the_reason(
        tmp_path, monkeypatch):
    """vLLM is alive when the optimizer step starts and dies with a step in flight, while the trainer
    waits to close the gate: the trainer stops with what happened and where --resume continues, as
    when it finds vLLM gone at the check or in a sync, not with a traceback."""
    import threading
    from types import SimpleNamespace

    from example_trainer.grpo import stop_reason

    exporter, worker_gate, _, bridge = attached_to_a_worker_that_can_die(tmp_path, monkeypatch, bf16_inplace=True)

    def die_once_the_trainer_waits() -> None:
        deadline = time.monotonic() + 30
        while worker_gate.file.status()["writer_waiting"] != os.getpid() and time.monotonic() < deadline:
            time.sleep(0.01)
        exporter.kill()  # the worker process exits mid-step (its step never ends)

    try:
        model = bridge.attach()
        worker_gate.begin_step()  # a vLLM step in flight: the trainer must wait for it at the gate
        killer = threading.Thread(target=die_once_the_trainer_waits)
        killer.start()
        try:
            with bridge.writing(model):
                pytest.fail("the trainer closed the gate of a vLLM worker that had exited")
        except Exception as err:  # noqa: BLE001 - what the loop's main gets, to stop with
            raised = err
        killer.join(30)
        assert exporter.wait(10) is not None and worker_gate.file.status()["writer_waiting"] == 0
        reason = stop_reason(SimpleNamespace(run_dir=tmp_path / "run", weights_step=3), raised)
        assert reason is not None, f"the trainer stops with a traceback: {type(raised).__name__}: {raised}"
        assert reason.startswith(f"[trainer] stopped: vLLM worker pid {exporter.pid} exited")
        assert "--resume continues from the model: no checkpoint was saved yet" in reason
    finally:
        worker_gate.end_step()
        bridge.close()
        worker_gate.close()


# Tensor parallel: two gloo ranks, each attached to "its vLLM worker's" shards (vllm_layout with
# tp_size 2), against the same tiny model unsharded.
TP_IDS = [[5, 17, 99, 3, 64, 120, 7, 2], [1, 2, 3, 4, 5, 6, 7, 8]]


def token_logprobs(logits: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor(TP_IDS)
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def tensor_parallel_rank(rank: int, tp_size: int, port: int, model_path: str, out: str) -> None:
    """One trainer rank: attach to rank ``rank``'s shards, forward, backward, one SGD step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from example_trainer.bridges.tensor_parallel import attach_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp_size)
    try:
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        shards = vllm_layout(hf, hf.config, tp_size, rank)  # what vLLM's TP worker `rank` would export
        pointers = {n: t.data_ptr() for n, t in shards.items()}
        mesh = init_device_mesh("cpu", (tp_size,))
        model = attach_tensor_parallel(model_path, shards, hf.config.architectures[0], tp_size, mesh, "fake export")
        logits = model(input_ids=torch.tensor(TP_IDS)).logits
        (-token_logprobs(logits).mean()).backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        moved = all(t.data_ptr() == pointers[n] for n, t in shards.items())
        torch.save({"logits": logits.detach(), "shards": shards, "same_storage": moved}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("config_cls,tied", [(LlamaConfig, True), (Qwen2Config, False)])
def test_tensor_parallel_ranks_compute_and_train_the_unsharded_model_on_their_shards(tmp_path, config_cls, tied):
    import torch.multiprocessing as mp

    from example_trainer.engine.ports import free_port

    torch.manual_seed(0)
    cfg = config_cls(**{**TINY, "vocab_size": 128, "tie_word_embeddings": tied})
    cfg.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    full = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    full.save_pretrained(tmp_path / "model")
    mp.spawn(tensor_parallel_rank, args=(2, free_port(), str(tmp_path / "model"), str(tmp_path)), nprocs=2)

    logits = full(input_ids=torch.tensor(TP_IDS)).logits
    (-token_logprobs(logits).mean()).backward()
    torch.optim.SGD(full.parameters(), lr=1.0).step()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["same_storage"]  # the step wrote into the exported tensors, no copy
        torch.testing.assert_close(result["logits"], logits.detach(), atol=1e-5, rtol=1e-5)
        trained = vllm_layout(full, cfg, 2, rank)  # the unsharded step, sharded as vLLM holds it
        assert result["shards"].keys() == trained.keys()
        for name, shard in result["shards"].items():
            torch.testing.assert_close(shard, trained[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("overrides,tp,vllm_tp,vocab_rows,says", [
    ({}, 2, 4, None, "vLLM serves with 4"),
    ({"num_key_value_heads": 1}, 2, 2, None, "KV heads (1)"),
    ({"intermediate_size": 63}, 2, 2, None, "intermediate size (63)"),
    ({"vocab_size": 100}, 2, 2, 64, "has 64 rows per rank"),  # padded to 128, an even split is 50
])
def test_tensor_parallel_refuses_splits_it_cannot_mirror(overrides, tp, vllm_tp, vocab_rows, says):
    from example_trainer.bridges.tensor_parallel import check_tensor_parallel

    with pytest.raises(AttachError, match=re.escape(says)):
        check_tensor_parallel(LlamaConfig(**{**TINY, **overrides}), tp, vllm_tp, vocab_rows)


def _cuda_handle_on(uuid: str | None, index: int):
    from vllm_patching.bridge_file import TensorHandle

    return TensorHandle(transport="cuda_ipc", shape=[1], stride=[1], tensor_offset=0, dtype="torch.bfloat16",
                        device_index=index, device_uuid=uuid, ipc_handle_b64="", storage_size=2)


def test_a_cuda_handle_opens_on_the_gpu_its_uuid_names_not_on_the_exporters_index(monkeypatch):
    """Data parallel on 2 GPUs hung: rank 1's vLLM, started with CUDA_VISIBLE_DEVICES=1, exported its
    weights as device 0, and rank 1's trainer (which sees both GPUs) opened them on its GPU 0."""
    from example_trainer.bridges import attach

    uuids = ["GPU-aaaa", "GPU-bbbb"]  # what this process sees: GPU 0 and GPU 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(attach, "gpu_uuid", lambda index: uuids[index])
    assert attach.local_cuda_index(_cuda_handle_on("GPU-bbbb", 0)) == 1  # vLLM's "cuda:0" is our GPU 1
    assert attach.local_cuda_index(_cuda_handle_on(None, 0)) == 0  # a file without UUIDs: the index
    with pytest.raises(AttachError, match="GPU-cccc, which this trainer does not see .*GPU-aaaa, GPU-bbbb"):
        attach.local_cuda_index(_cuda_handle_on("GPU-cccc", 0))
