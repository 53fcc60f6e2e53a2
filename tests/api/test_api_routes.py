"""Registration, status, idempotency, auth, body limits and reset, through the in-process app."""

from __future__ import annotations

import gzip
import json

import pytest
from api_testlib import make_group, queue_size, register_trainer
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import ApiSettings

ENV = {"max_token_length": 16, "desired_name": "gsm8k", "weight": 1.0, "group_size": 4}


def test_root_says_hello(client):
    assert client.get("/").json() == {"message": "onecopy trajectory API"}


def test_info_and_wandb_info_before_and_after_trainer_registers(client):
    assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert client.get("/wandb_info").json() == {"group": None, "project": None}
    register_trainer(client, wandb_group="g", wandb_project="p")
    assert client.get("/info").json() == {"batch_size": 8, "max_token_len": 16}
    assert client.get("/wandb_info").json() == {"group": "g", "project": "p"}


def test_register_returns_a_uuid(client):
    assert isinstance(register_trainer(client).json()["uuid"], str)


def test_register_env_waits_for_trainer(client):
    assert client.post("/register-env", json=ENV).json() == {"status": "wait for trainer to start"}


def test_register_env_returns_atropos_fields(client):
    register_trainer(client, checkpoint_dir="/ckpt", save_checkpoint_interval=5, starting_step=3)
    first = client.post("/register-env", json=ENV).json()
    second = client.post("/register-env", json=ENV).json()
    assert first == {"status": "success", "env_id": 0, "wandb_name": "gsm8k_0",
                     "checkpoint_dir": "/ckpt", "starting_step": 3, "checkpoint_interval": 5,
                     "num_steps": 100}
    assert (second["env_id"], second["wandb_name"]) == (1, "gsm8k_1")


def test_re_registration_replaces_config_and_keeps_queue(trainer_client):
    trainer_client.post("/scored_data", json=make_group(4))
    register_trainer(trainer_client, batch_size=4, starting_step=10)
    assert trainer_client.get("/info").json()["batch_size"] == 4
    assert trainer_client.get("/status").json() == {"current_step": 10, "queue_size": 1, "queued_sequences": 4,
                                                    "batch_ready": True}
    assert len(trainer_client.get("/batch").json()["batch"]) == 1
    assert trainer_client.get("/status").json()["current_step"] == 11


def test_disconnect_unknown_env_is_404_naming_env_id(trainer_client):
    response = trainer_client.post("/disconnect-env", json={"env_id": 99})
    assert response.status_code == 404
    assert "env_id=99" in response.json()["detail"]


def test_disconnect_env_removes_its_weight(trainer_client):
    trainer_client.post("/register-env", json=ENV)
    trainer_client.post("/register-env", json={**ENV, "weight": 3.0})
    before = trainer_client.post("/status-env", json={"env_id": 0}).json()["env_weight"]
    assert trainer_client.post("/disconnect-env", json={"env_id": 1}).json() == {"status": "success"}
    after = trainer_client.post("/status-env", json={"env_id": 0}).json()["env_weight"]
    assert (before, after) == (pytest.approx(0.25), pytest.approx(1.0))


def test_status_env_answers_get_with_body_like_atropos(trainer_client):
    trainer_client.post("/register-env", json=ENV)
    trainer_client.post("/scored_data", json=make_group(4, env_id=0))
    trainer_client.post("/scored_data", json=make_group(4))
    status = trainer_client.request("GET", "/status-env", json={"env_id": 0}).json()
    assert status == {"current_step": 0, "queue_size": 2, "self_queue_size": 1, "max_group_size": 4,
                      "unallocated_fraction": 1.0, "env_weight": 1.0}


def test_status_env_unknown_env_is_404(trainer_client):
    response = trainer_client.request("GET", "/status-env", json={"env_id": 5})
    assert response.status_code == 404
    assert "env_id=5" in response.json()["detail"]


def test_same_group_uuid_is_stored_once(trainer_client):
    group = make_group(4, group_uuid="abc")
    assert trainer_client.post("/scored_data", json=group).json() == {"status": "received"}
    assert trainer_client.post("/scored_data", json=group).json() == {"status": "duplicate"}
    assert queue_size(trainer_client) == 1


def test_group_uuid_stays_a_duplicate_after_the_group_was_served(trainer_client):
    group = make_group(8, group_uuid="served")
    trainer_client.post("/scored_data", json=group)
    assert trainer_client.get("/batch").json()["batch"] is not None
    assert trainer_client.post("/scored_data", json=group).json() == {"status": "duplicate"}
    assert queue_size(trainer_client) == 0


def test_list_skips_duplicates_inside_and_across_posts(trainer_client):
    trainer_client.post("/scored_data", json=make_group(2, group_uuid="a"))
    groups = [make_group(2, group_uuid="a"), make_group(2, group_uuid="b"),
              make_group(2, group_uuid="b"), make_group(2)]
    response = trainer_client.post("/scored_data_list", json=groups).json()
    assert response == {"status": "received", "groups_processed": 4, "duplicates": 2}
    assert queue_size(trainer_client) == 3


def test_latest_example_is_the_last_group_as_posted(client):
    assert client.get("/latest_example").json()["tokens"] == []
    register_trainer(client)
    client.post("/scored_data", json=make_group(2, tag=1))
    client.post("/scored_data", json=make_group(3, tag=2, generation_params={"temperature": 1.0}))
    latest = client.get("/latest_example").json()
    assert latest["tokens"] == [[2, 2, 2]] * 3
    assert latest["generation_params"] == {"temperature": 1.0}


def test_reset_clears_queue_registrations_and_step(trainer_client):
    trainer_client.post("/register-env", json=ENV)
    trainer_client.post("/scored_data", json=make_group(8, group_uuid="x"))
    trainer_client.post("/scored_data", json=make_group(4))
    trainer_client.get("/batch")
    assert trainer_client.get("/reset_data").text == "Reset successful"
    assert trainer_client.get("/status").json() == {"current_step": 0, "queue_size": 0, "queued_sequences": 0}
    assert trainer_client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert trainer_client.post("/register-env", json=ENV).json()["status"] != "success"
    register_trainer(trainer_client)
    assert trainer_client.post("/register-env", json=ENV).json()["env_id"] == 0
    assert trainer_client.post("/scored_data", json=make_group(8, group_uuid="x")).json() == {
        "status": "received"}


def test_state_survives_a_new_app_on_the_same_db(settings):
    with TestClient(create_app(settings)) as first:
        register_trainer(first)
        first.post("/register-env", json=ENV)
        first.post("/scored_data", json=make_group(8, env_id=0, group_uuid="g1"))
        first.post("/scored_data", json=make_group(8, env_id=0, group_uuid="g2"))
        first.get("/batch")
    with TestClient(create_app(settings)) as second:
        assert second.get("/status").json() == {"current_step": 1, "queue_size": 1, "queued_sequences": 8,
                                                "batch_ready": True}
        assert second.get("/info").json()["batch_size"] == 8
        assert second.post("/scored_data", json=make_group(8, env_id=0, group_uuid="g1")).json() == {
            "status": "duplicate"}
        assert second.get("/batch").json()["batch"][0]["group_uuid"] == "g2"


@pytest.fixture
def secured(tmp_path):
    settings = ApiSettings(db_path=str(tmp_path / "secured.db"), api_key="s3cret")
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _routes(app) -> list[tuple[str, str]]:
    return sorted((method, route.path) for route in app.routes
                  for method in getattr(route, "methods", ()) if method != "HEAD")


def test_every_route_but_root_needs_the_api_key(secured):
    routes = _routes(secured.app)
    assert ("POST", "/scored_data") in routes
    for method, path in routes:
        response = secured.request(method, path)
        expected = 200 if (method, path) == ("GET", "/") else 401
        assert response.status_code == expected, (method, path, response.text)


def test_wrong_api_key_is_401_and_right_one_passes(secured):
    assert secured.get("/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert secured.get("/status", headers={"Authorization": "s3cret"}).status_code == 401
    response = secured.get("/status", headers={"Authorization": "Bearer s3cret"})
    assert response.status_code == 200


def test_unauthenticated_body_is_refused_before_it_is_parsed(secured):
    response = secured.post("/scored_data", content=b"{not json",
                            headers={"Content-Type": "application/json"})
    assert response.status_code == 401
    assert "Authorization: Bearer" in response.json()["detail"]


@pytest.fixture
def small_body_client(tmp_path):
    settings = ApiSettings(db_path=str(tmp_path / "small.db"), api_key=None, max_body_bytes=2048)
    with TestClient(create_app(settings)) as test_client:
        register_trainer(test_client)
        yield test_client


def _big_group() -> bytes:
    return json.dumps(make_group(8, length=16, inference_logprobs=[[-0.123456789] * 16] * 8)).encode()


def test_body_over_limit_by_content_length_is_413(small_body_client):
    body = _big_group()
    assert len(body) > 2048
    response = small_body_client.post("/scored_data", content=body,
                                      headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert "max_body_bytes=2048" in response.json()["detail"]
    assert queue_size(small_body_client) == 0


def test_chunked_body_over_limit_is_413_without_content_length(small_body_client):
    body = _big_group()

    def chunks():
        for start in range(0, len(body), 512):
            yield body[start:start + 512]

    response = small_body_client.post("/scored_data", content=chunks(),
                                      headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert queue_size(small_body_client) == 0


def test_gzip_body_is_decoded_like_atropos_sends_it(small_body_client):
    body = gzip.compress(json.dumps(make_group(4)).encode())
    response = small_body_client.post("/scored_data", content=body, headers={
        "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert response.json() == {"status": "received"}


def test_gzip_body_over_limit_once_decoded_is_413(small_body_client):
    body = gzip.compress(_big_group())
    assert len(body) < 2048
    response = small_body_client.post("/scored_data", content=body, headers={
        "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert response.status_code == 413
    assert queue_size(small_body_client) == 0


def test_corrupt_gzip_body_is_400(small_body_client):
    response = small_body_client.post("/scored_data", content=b"\x1f\x8b not gzip", headers={
        "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert response.status_code == 400
    assert "gzip" in response.json()["detail"]


def test_openapi_schema_lists_the_atropos_paths(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/register", "/register-env", "/disconnect-env", "/info", "/wandb_info", "/batch",
            "/scored_data", "/scored_data_list", "/latest_example", "/status", "/status-env",
            "/reset_data"} <= set(paths)


def test_a_file_that_is_not_a_database_fails_with_what_to_do(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("not sqlite at all, " * 100)
    with pytest.raises(RuntimeError, match="--db-path"):
        create_app(ApiSettings(db_path=str(path), api_key=None))
