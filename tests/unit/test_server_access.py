"""Who may call onecopy's vLLM routes, without starting vLLM: the LoRA root's path check, the
bearer check built on vLLM's own middleware class, the open-bind warning, the clients' header.
The same rules against a running server: tests/integration/test_api_key_cpu.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from vllm_patching.auth import api_key_dependencies, is_loopback, warn_if_open
from vllm_patching.lora_routes import OutsideLoraRoot, folder_under_root

KEY = "sk-unit-test"


def test_a_folder_under_the_root_is_given_back_resolved(tmp_path):
    (tmp_path / "run" / "adapters" / "step_1").mkdir(parents=True)
    given = tmp_path / "run" / "adapters" / ".." / "adapters" / "step_1"
    assert folder_under_root(str(given), tmp_path / "run") == (tmp_path / "run" / "adapters" / "step_1").resolve()


@pytest.mark.parametrize("path", ["elsewhere/adapter", "run/../elsewhere/adapter", "run2/adapter", "/etc"])
def test_a_folder_outside_the_root_is_refused_naming_the_root(tmp_path, path):
    root = tmp_path / "run"
    root.mkdir()
    with pytest.raises(OutsideLoraRoot, match=f"outside this server's LoRA root {root.resolve()}: .*--lora-root"):
        folder_under_root(path if path.startswith("/") else str(tmp_path / path), root)


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "run" / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(OutsideLoraRoot):
        folder_under_root(str(tmp_path / "run" / "link"), tmp_path / "run")


def guarded_app(api_key: list[str] | None) -> TestClient:
    app = FastAPI()
    router = APIRouter()
    router.get("/generate")(lambda: {"ok": True})
    app.include_router(router, dependencies=api_key_dependencies(SimpleNamespace(api_key=api_key)))
    return TestClient(app)


def test_a_route_with_the_key_dependency_needs_the_bearer_token():
    client = guarded_app([KEY])
    assert client.get("/generate").status_code == 401
    assert client.get("/generate", headers={"Authorization": "Bearer wrong"}).status_code == 401
    refused = client.get("/generate", headers={"Authorization": f"Basic {KEY}"})
    assert refused.status_code == 401 and "VLLM_API_KEY" in refused.json()["detail"]
    assert client.get("/generate", headers={"Authorization": f"Bearer {KEY}"}).json() == {"ok": True}


def test_any_of_several_keys_is_accepted_and_the_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    client = guarded_app([KEY, "second"])
    assert client.get("/generate", headers={"Authorization": "Bearer second"}).status_code == 200
    assert client.get("/generate", headers={"Authorization": "Bearer from-env"}).status_code == 401


def test_vllm_api_key_alone_guards_the_route(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    client = guarded_app(None)
    assert client.get("/generate").status_code == 401
    assert client.get("/generate", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_without_any_key_the_route_stays_open(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert guarded_app(None).get("/generate").status_code == 200


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("::1", True), ("localhost", True), ("127.0.0.2", True),
    ("0.0.0.0", False), ("::", False), (None, False), ("", False), ("10.1.2.3", False), ("myhost", False),
])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_binding_beyond_loopback_without_a_key_warns_and_with_one_does_not(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(logging.getLogger("vllm.onecopy.auth"), "propagate", True)  # vLLM's config may stop it
    with caplog.at_level(logging.WARNING, logger="vllm.onecopy.auth"):
        warn_if_open(SimpleNamespace(host="0.0.0.0", port=9001, api_key=None))
        assert "without an API key" in caplog.text and "VLLM_API_KEY" in caplog.text
        caplog.clear()
        warn_if_open(SimpleNamespace(host="0.0.0.0", port=9001, api_key=[KEY]))
        warn_if_open(SimpleNamespace(host="127.0.0.1", port=9001, api_key=None))
        assert caplog.text == ""


def test_the_clients_send_vllm_api_key_as_a_bearer_header_only_when_it_is_set(monkeypatch):
    from environments.clients import inference_headers
    from example_trainer.engine.vllm_process import vllm_auth_headers

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert vllm_auth_headers() == inference_headers() == {}
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert vllm_auth_headers() == inference_headers() == {"Authorization": f"Bearer {KEY}"}


def test_lora_root_defaults_to_logdir_and_the_flag_wins(monkeypatch, tmp_path, default_model):
    from vllm_patching.api_server import parse_args

    monkeypatch.setenv("LOGDIR", str(tmp_path / "run"))
    assert parse_args(["--model", default_model]).lora_root == str((tmp_path / "run").resolve())
    given = parse_args(["--model", default_model, "--lora-root", str(tmp_path / "adapters" / "..")])
    assert given.lora_root == str(tmp_path.resolve())
