"""LoRA bridges without vLLM: config checks, PEFT adapter files, version names, and the swap
protocol against a tiny fake server (including one that only comes up after a while)."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from environments.config_flags import parse_config
from example_trainer.bridges import bridge_class
from example_trainer.bridges.lora import (LoraOnlyBridge, LoraRestartBridge, post_with_retry, save_adapter,
                                          target_modules, version_name, vllm_lora_args)
from example_trainer.config import TrainerConfig
from tests.conftest import free_port

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def lora_cfg(port: int = 1, **kw) -> TrainerConfig:
    return TrainerConfig(weight_bridge_mode="lora_only", launch_vllm=False, vllm_server_port=port, **kw)


class FakeTokenizer:
    def save_pretrained(self, folder):
        (folder / "tokenizer_config.json").write_text("{}")


def lora_info(*series: tuple[float, str, str]) -> str:
    """vLLM's /metrics text with its LoRA gauge: one (time set, running names, waiting names) per series."""
    lines = ["# HELP vllm:lora_requests_info Running stats on lora requests.", "# TYPE vllm:lora_requests_info gauge"]
    lines += [f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",waiting_lora_adapters='
              f'"{waiting}"}} {when!r}' for when, running, waiting in series]
    return "\n".join(["# HELP vllm:num_requests_running x", "vllm:num_requests_running 0.0", *lines]) + "\n"


class FakeLoraServer:
    """Answers /lora/load and /lora/unload like onecopy's server, and GET /metrics with
    ``metrics`` (no LoRA requests unless a test sets it); records every POST."""

    def __init__(self, port: int, load_status: int = 200):
        self.requests: list[tuple[str, dict]] = []
        self.port = port
        self.metrics = lora_info((1.7e9, "", ""))
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                payload = owner.metrics.encode() if self.path == "/metrics" else b""
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append((self.path, body))
                status = load_status if self.path == "/lora/load" else 200
                payload = json.dumps({"detail": "adapter rank too large"} if status != 200 else {"current": body.get("lora_name")})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload.encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, flag", [
    (dict(lora_r=0), "--lora-r"),
    (dict(lora_alpha=0), "--lora-alpha"),
    (dict(lora_dropout=1.0), "--lora-dropout"),
    (dict(lora_sync_interval=0), "--lora-sync-interval"),
    (dict(lora_target_modules="q_proj,,v_proj"), "--lora-target-modules"),
])
def test_config_rejects_bad_lora_values_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        TrainerConfig(weight_bridge_mode="lora_only", **kw)


def test_config_rejects_lora_flags_in_other_modes():
    with pytest.raises(ValueError, match="--lora-r only applies to --weight-bridge-mode lora_only or lora_restart"):
        TrainerConfig(weight_bridge_mode="shared_vllm", lora_r=8)


def test_config_lora_restart_needs_its_own_vllm_and_ignores_no_sync_interval():
    with pytest.raises(ValueError, match="drop --launch-vllm false"):
        TrainerConfig(weight_bridge_mode="lora_restart", launch_vllm=False)
    with pytest.raises(ValueError, match="--lora-sync-interval is for lora_only"):
        TrainerConfig(weight_bridge_mode="lora_restart", lora_sync_interval=2)


def test_cli_parses_lora_flags_and_modes():
    cfg = parse_config(TrainerConfig, ["--weight-bridge-mode", "lora_only", "--lora-r", "8", "--lora-alpha", "16",
                                       "--lora-target-modules", "q_proj,v_proj", "--lora-sync-interval", "2"])
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_sync_interval) == (8, 16, 2)
    assert bridge_class("lora_only") is LoraOnlyBridge
    with pytest.raises(ValueError, match="valid: none, shared_vllm, lora_only, lora_restart"):
        bridge_class("lora")


def test_target_modules_default_per_family_and_explicit():
    assert target_modules(lora_cfg(), "llama") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert target_modules(lora_cfg(lora_target_modules="q_proj, v_proj"), "gpt2") == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="pass the names"):
        target_modules(lora_cfg(), "gpt2")


def test_vllm_max_lora_rank_is_the_smallest_allowed_value_that_fits():
    assert vllm_lora_args(lora_cfg(lora_r=4))[:3] == ["--enable-lora", "--max-lora-rank", "8"]
    assert vllm_lora_args(lora_cfg(lora_r=16))[2] == "16"
    with pytest.raises(ValueError, match="--lora-r 600"):
        vllm_lora_args(lora_cfg(lora_r=600))


# --- model and adapter files -------------------------------------------------------------------

def test_only_fp32_adapters_train_and_base_stays_frozen(tiny_model_path, tmp_path):
    bridge = LoraOnlyBridge(lora_cfg(lora_r=4), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    params = bridge.optimizer_parameters(model)
    assert bridge.masters is None
    assert params and all(p.dtype == torch.float32 for p in params)
    assert len(params) == 2 * 7 * TINY["num_hidden_layers"]  # A and B of 7 projections per layer
    frozen = [p for p in model.parameters() if not p.requires_grad]
    # the frozen base computes in fp32 on CPU (bf16 matmuls are ~35x slower there), bf16 on GPU
    assert frozen and all(p.dtype == torch.float32 for p in frozen)
    tokens = torch.tensor([[1, 5, 7, 9]])
    model(input_ids=tokens).logits.float().mean().backward()
    assert all(p.grad is not None for p in params) and all(p.grad is None for p in frozen)


def test_saved_adapter_is_peft_format_and_loads_with_the_same_weights(tiny_model_path, tmp_path):
    bridge = LoraOnlyBridge(lora_cfg(lora_r=4), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B starts at zero: make the adapter matter
    name, folder, nbytes = bridge.save_version(model, step=3)
    assert folder == tmp_path / "adapters" / "step_3"
    assert (folder / "adapter_config.json").exists() and nbytes == (folder / "adapter_model.safetensors").stat().st_size
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == tiny_model_path
    assert not (tmp_path / "adapters" / "step_3.tmp").exists()

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)  # as the bridge on CPU
    loaded = PeftModel.from_pretrained(base, str(folder))
    tokens = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    assert all(t.abs().sum() > 0 for k, t in load_file(folder / "adapter_model.safetensors").items() if "lora_B" in k)


def test_checkpoint_resumes_with_the_adapter_and_its_base(tiny_model_path, tmp_path):
    bridge = LoraOnlyBridge(lora_cfg(lora_r=4), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    with torch.no_grad():
        for p in bridge.optimizer_parameters(model):
            p.add_(0.05)
    folder = bridge.save_checkpoint(model, FakeTokenizer(), tmp_path / "checkpoints" / "step_2")
    resumed = LoraOnlyBridge(lora_cfg(lora_r=4), str(folder), tmp_path, torch.device("cpu"))
    assert resumed.base_path == tiny_model_path and resumed.resume_adapter == folder
    again = resumed.build_model()
    for a, b in zip(bridge.optimizer_parameters(model), resumed.optimizer_parameters(again)):
        assert b.requires_grad and b.dtype == torch.float32
        torch.testing.assert_close(a, b)


def test_save_adapter_replaces_a_folder_from_an_earlier_run(tiny_model_path, tmp_path):
    bridge = LoraOnlyBridge(lora_cfg(lora_r=4), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    folder = tmp_path / "adapters" / "step_1"
    folder.mkdir(parents=True)
    (folder / "stale.txt").write_text("old")
    save_adapter(model, folder)
    assert not (folder / "stale.txt").exists() and (folder / "adapter_model.safetensors").exists()


def test_version_names_are_unique_across_steps_and_runs(tiny_model_path, tmp_path):
    one = LoraOnlyBridge(lora_cfg(), tiny_model_path, tmp_path, torch.device("cpu"))
    two = LoraOnlyBridge(lora_cfg(), tiny_model_path, tmp_path, torch.device("cpu"))
    names = {version_name(step, b.tag) for b in (one, two) for step in range(1, 51)}
    assert len(names) == 100
    assert version_name(7, one.tag).startswith("policy-") and version_name(7, one.tag).endswith("-step-7")


# --- the swap protocol -------------------------------------------------------------------------

def test_swap_loads_the_new_version_then_unloads_the_previous(tiny_model_path, tmp_path):
    port = free_port()
    server = FakeLoraServer(port)
    try:
        bridge = LoraOnlyBridge(lora_cfg(port, lora_r=4), tiny_model_path, tmp_path, torch.device("cpu"))
        model = bridge.attach()
        first = bridge.sync(model, step=1, final=False)
        bridge.sync(model, step=2, final=True)
    finally:
        server.stop()
    paths = [(path, body.get("lora_name")) for path, body in server.requests]
    one, two = version_name(1, bridge.tag), version_name(2, bridge.tag)
    assert paths == [("/lora/load", one), ("/lora/load", two), ("/lora/unload", one)]
    assert server.requests[0][1]["lora_path"] == str(tmp_path / "adapters" / "step_1")
    assert first["sync/synced"] == 1.0 and first["sync/load_attempts"] == 1.0
    assert first["sync/bytes_moved"] == (tmp_path / "adapters" / "step_1" / "adapter_model.safetensors").stat().st_size
    assert first["sync/seconds"] >= first["sync/save_seconds"] + first["sync/load_seconds"] - 1e-6
    assert bridge.current == two


@pytest.fixture
def fake_server():
    """A FakeLoraServer on a free port, stopped after the test."""
    server = FakeLoraServer(free_port())
    yield server
    server.stop()


def versions_on_disk(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "adapters").iterdir())


def test_lora_only_deletes_versions_but_the_current_the_previous_and_those_requests_still_use(
        fake_server, tiny_model_path, tmp_path):
    bridge = LoraOnlyBridge(lora_cfg(fake_server.port, lora_r=4), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    (tmp_path / "adapters" / "step_0.tmp").mkdir(parents=True)  # a save that stopped half-way
    (tmp_path / "adapters" / "notes.txt").write_text("not an adapter version")
    # vLLM says: a request of step 2's version still runs, one of step 3's (another run's) waits;
    # step 1's series is older (those requests have ended).
    running = f"{version_name(2, bridge.tag)},other-adapter"
    fake_server.metrics = lora_info((1.7e9 + 1, version_name(1, bridge.tag), ""),
                                    (1.7e9 + 2, running, version_name(3, "0abc")))
    for step in range(1, 7):
        bridge.sync(model, step=step, final=False)
    assert versions_on_disk(tmp_path) == ["notes.txt", "step_2", "step_3", "step_5", "step_6"]
    fake_server.metrics = lora_info((1.7e9 + 3, "", ""))  # those requests ended
    bridge.sync(model, step=7, final=False)
    assert versions_on_disk(tmp_path) == ["notes.txt", "step_6", "step_7"]
    assert bridge.current == version_name(7, bridge.tag)


def test_lora_only_keeps_every_version_while_vllm_does_not_say_which_requests_use_them(
        fake_server, tiny_model_path, tmp_path, caplog):
    # vLLM started with --disable-log-stats: no LoRA gauge
    fake_server.metrics = "# HELP vllm:num_requests_running x\nvllm:num_requests_running 0.0\n"
    bridge = LoraOnlyBridge(lora_cfg(fake_server.port, lora_r=4), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    with caplog.at_level(logging.WARNING, logger="onecopy.trainer.bridge"):
        for step in range(1, 4):
            bridge.sync(model, step=step, final=False)
    assert versions_on_disk(tmp_path) == ["step_1", "step_2", "step_3"]
    assert caplog.text.count("does not report which adapters its requests use") == 1
    assert "old versions in" in caplog.text and "are kept, not deleted" in caplog.text


class FakeVllmProcess:
    """The loop's vLLM server as sync_by_restart drives it: records each restart."""

    def __init__(self):
        self.restarts: list[list[str]] = []

    def restart(self, model, extra_args):
        self.restarts.append(extra_args)

    def ensure_alive(self):
        pass


def test_lora_restart_keeps_only_the_version_vllm_was_restarted_on(tiny_model_path, tmp_path):
    server = FakeVllmProcess()
    cfg = TrainerConfig(weight_bridge_mode="lora_restart", vllm_restart_interval=1, lora_r=4)
    bridge = LoraRestartBridge(cfg, tiny_model_path, tmp_path, torch.device("cpu"), server=server)
    model = bridge.attach()
    for step in range(1, 4):
        bridge.sync(model, step=step, final=False)
        assert versions_on_disk(tmp_path) == [f"step_{step}"]
    bridge.sync(model, step=4, final=True)  # no restart after the last step: nothing saved or deleted
    assert versions_on_disk(tmp_path) == ["step_3"]
    assert len(server.restarts) == 3 and str(tmp_path / "adapters" / "step_3") in server.restarts[-1][-1]


def test_sync_interval_skips_steps(tiny_model_path, tmp_path):
    bridge = LoraOnlyBridge(lora_cfg(lora_r=4, lora_sync_interval=2), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    assert bridge.sync(model, step=1, final=False) == {"sync/synced": 0.0}
    assert not (tmp_path / "adapters").exists()


def test_swap_retries_while_the_server_is_down_and_loads_once_it_is_up(tiny_model_path, tmp_path):
    port = free_port()
    bridge = LoraOnlyBridge(lora_cfg(port, lora_r=4, vllm_server_timeout=60), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    servers = []
    # Nothing listens on the port for the first ~2 s: connection refused, then the server comes up.
    timer = threading.Timer(2.0, lambda: servers.append(FakeLoraServer(port)))
    timer.start()
    try:
        start = time.monotonic()
        metrics = bridge.sync(model, step=1, final=False)
        assert time.monotonic() - start >= 1.5
    finally:
        timer.join()
        for s in servers:
            s.stop()
    assert metrics["sync/load_attempts"] >= 2
    assert servers[0].requests == [("/lora/load", {"lora_name": version_name(1, bridge.tag),
                                                   "lora_path": str(tmp_path / "adapters" / "step_1")})]


def test_swap_gives_up_at_the_deadline_and_keeps_the_adapter_on_disk(tiny_model_path, tmp_path):
    port = free_port()  # nothing will ever listen here
    bridge = LoraOnlyBridge(lora_cfg(port, lora_r=4, vllm_server_timeout=2), tiny_model_path, tmp_path, torch.device("cpu"))
    model = bridge.attach()
    with pytest.raises(TimeoutError, match="still unreachable after .* the adapter stays on disk at .*step_1"):
        bridge.sync(model, step=1, final=False)
    assert (tmp_path / "adapters" / "step_1" / "adapter_model.safetensors").exists()
    assert bridge.current is None


def test_swap_fails_at_once_on_a_client_error():
    port = free_port()
    server = FakeLoraServer(port, load_status=400)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="answered 400: .*adapter rank too large"):
            post_with_retry(f"http://127.0.0.1:{port}", "/lora/load", {"lora_name": "x", "lora_path": "/x"}, 30)
        assert time.monotonic() - start < 5 and len(server.requests) == 1
    finally:
        server.stop()
