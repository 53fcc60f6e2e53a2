"""Every bad scored group is refused with a 4xx whose detail names the field, and nothing is stored."""

from __future__ import annotations

import base64
import json

import pytest
from api_testlib import BATCH_SIZE, MAX_TOKEN_LEN, make_group, queue_size, register_trainer


def _with(**changes: object) -> dict:
    return {**make_group(4), **changes}


def _without(field: str) -> dict:
    group = make_group(4)
    del group[field]
    return group


def _distill(ids_rows: int = 4, logprob_rows: int = 4, length: int = 3, top_k: int = 2) -> dict:
    """Teacher top-k fields for `make_group(4)`: `length` positions of `top_k` entries per row."""
    return {
        "distill_token_ids": [[list(range(top_k))] * length for _ in range(ids_rows)],
        "distill_logprobs": [[[-0.5] * top_k] * length for _ in range(logprob_rows)],
    }


def _distill_with_row(field: str, row: int, positions: list) -> dict:
    fields = _distill()
    fields[field][row] = positions
    return fields


def _routes(positions: int = 2, layers: int = 2, top_k: int = 2, dtype: str = "uint8", **changes: object) -> dict:
    """One sequence's routed_experts in vLLM's wire form: `positions` x layers x top_k expert ids."""
    data = base64.b64encode(bytes(positions * layers * top_k * (2 if dtype == "uint16" else 1))).decode()
    return {"layers": layers, "top_k": top_k, "dtype": dtype, "data": data, **changes}


BAD_GROUPS = {
    "masks_count": (_with(masks=[[-100, 1, 1]] * 3), "masks"),
    "scores_count": (_with(scores=[1.0, 2.0]), "scores"),
    "inference_logprobs_count": (_with(inference_logprobs=[[0.0] * 3] * 5), "inference_logprobs"),
    "advantages_count": (_with(advantages=[[0.5] * 3]), "advantages"),
    "ref_logprobs_count": (_with(ref_logprobs=[[0.0] * 3] * 2), "ref_logprobs"),
    "mask_shorter_than_tokens": (_with(masks=[[-100, 1, 1], [-100, 1], [-100, 1, 1], [-100, 1, 1]]),
                                 "masks[1]"),
    "inference_logprobs_row_short": (_with(inference_logprobs=[[0.0] * 3, [0.0] * 2, [0.0] * 3, [0.0] * 3]),
                                     "inference_logprobs[1]"),
    "advantages_row_long": (_with(advantages=[[0.5] * 3, [0.5] * 3, [0.5] * 4, [0.5] * 3]), "advantages[2]"),
    "ref_logprobs_row_short": (_with(ref_logprobs=[[0.0]] * 4), "ref_logprobs[0]"),
    "weight_versions_count": (_with(weight_versions=[[-1, 0, 0]] * 3), "weight_versions"),
    "weight_versions_row_short": (_with(weight_versions=[[-1, 0, 0], [-1, 0, 0], [-1, 0], [-1, 0, 0]]),
                                  "weight_versions[2]"),
    "routed_experts_count": (_with(routed_experts=[_routes()] * 3), "routed_experts"),
    "routed_experts_one_position_per_token": (_with(routed_experts=[_routes(), _routes(), _routes(3), _routes()]),
                                              "routed_experts[2].data"),
    "routed_experts_other_shape": (_with(routed_experts=[_routes(), _routes(layers=1, top_k=4)] + [_routes()] * 2),
                                   "routed_experts[1]"),
    "routed_experts_not_base64": (_with(routed_experts=[_routes(data="not base64!")] * 4), "routed_experts[0].data"),
    "routed_experts_dtype": (_with(routed_experts=[_routes(dtype="int64")] * 4), "routed_experts[0].dtype"),
    "routed_experts_no_layers": (_with(routed_experts=[_routes(layers=0)] * 4), "routed_experts[0].layers"),
    "distill_token_ids_count": (_with(**_distill(ids_rows=3)), "distill_token_ids"),
    "distill_logprobs_count": (_with(**_distill(logprob_rows=5)), "distill_logprobs"),
    "distill_token_ids_row_short": (_with(**_distill_with_row("distill_token_ids", 1, [[0, 1]] * 2)),
                                    "distill_token_ids[1]"),
    "distill_logprobs_row_long": (_with(**_distill_with_row("distill_logprobs", 2, [[-0.5, -0.5]] * 4)),
                                  "distill_logprobs[2]"),
    "distill_top_k_differs": (_with(**_distill_with_row("distill_logprobs", 0, [[-0.5, -0.5], [-0.5], [-0.5, -0.5]])),
                              "distill_logprobs[0][1]"),
    "distill_logprobs_missing": (_with(distill_token_ids=_distill()["distill_token_ids"]), "distill_logprobs"),
    "distill_token_ids_missing": (_with(distill_logprobs=_distill()["distill_logprobs"], distill_token_ids=[]),
                                  "distill_token_ids"),
    "distill_token_id_negative": (_with(**_distill_with_row("distill_token_ids", 0, [[0, -1]] * 3)),
                                  "distill_token_ids[0][0][1]"),
    "message_without_content": (_with(messages=[[{"role": "user", "content": "hi"}, {"role": "assistant"}]] * 4),
                                "messages[0][1]"),
    "message_without_role": (_with(messages=[[{"content": "hi"}]] * 4), "messages[0][0]"),
    "empty_group": ({"tokens": [], "masks": [], "scores": []}, "tokens"),
    "empty_sequence": (_with(tokens=[[1, 1, 1], [], [1, 1, 1], [1, 1, 1]]), "tokens[1]"),
    "too_long": (make_group(2, length=MAX_TOKEN_LEN + 1), "tokens[0]"),
    "larger_than_batch": (make_group(BATCH_SIZE + 1), "tokens"),
    "missing_masks": (_without("masks"), "masks"),
    "token_not_int": (_with(tokens=[["a", 1, 1]] * 4), "tokens[0][0]"),
    "negative_token": (_with(tokens=[[1, -5, 1]] * 4), "tokens[0][1]"),
    "env_id_not_int": (_with(env_id="zero"), "env_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_GROUPS))
def test_bad_group_is_refused_naming_the_field(trainer_client, case):
    group, field = BAD_GROUPS[case]
    response = trainer_client.post("/scored_data", json=group)
    assert response.status_code == 422, response.text
    fields = [error["field"] for error in response.json()["detail"]]
    assert field in fields
    assert any(error["msg"].startswith(field) for error in response.json()["detail"])
    assert queue_size(trainer_client) == 0


def test_group_larger_than_batch_size_says_it_could_never_be_served(trainer_client):
    response = trainer_client.post("/scored_data", json=make_group(BATCH_SIZE + 1))
    assert "batch_size is 8" in response.json()["detail"][0]["msg"]
    assert "never" in response.json()["detail"][0]["msg"]


def test_sequence_longer_than_max_token_len_names_the_limit(trainer_client):
    response = trainer_client.post("/scored_data", json=make_group(1, length=MAX_TOKEN_LEN + 1))
    assert f"max_token_len={MAX_TOKEN_LEN}" in response.json()["detail"][0]["msg"]


def test_sequence_of_exactly_max_token_len_is_accepted(trainer_client):
    response = trainer_client.post("/scored_data", json=make_group(1, length=MAX_TOKEN_LEN))
    assert response.json() == {"status": "received"}


def _post_raw(client, text: str):
    return client.post("/scored_data", content=text.encode(),
                       headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("literal, field", [
    ('{"tokens": [[1]], "masks": [[1]], "scores": [NaN]}', "scores[0]"),
    ('{"tokens": [[1], [1]], "masks": [[1], [1]], "scores": [1.0, Infinity]}', "scores[1]"),
    ('{"tokens": [[1]], "masks": [[1]], "scores": [-Infinity]}', "scores[0]"),
    ('{"tokens": [[1]], "masks": [[1]], "scores": [1], "advantages": [[NaN]]}', "advantages[0][0]"),
    ('{"tokens": [[1]], "masks": [[1]], "scores": [1], "distill_token_ids": [[[5]]], '
     '"distill_logprobs": [[[NaN]]]}', "distill_logprobs[0][0][0]"),
    ('{"tokens": [[1]], "masks": [[1]], "scores": [1], "generation_params": {"t": NaN}}',
     "generation_params"),
    ('{"tokens": [[1]], "masks": [[1]], "scores": [1], "overrides": [{"w": [Infinity]}]}',
     "overrides"),
])
def test_non_finite_numbers_are_refused_naming_the_field(trainer_client, literal, field):
    response = _post_raw(trainer_client, literal)
    assert response.status_code == 422, response.text
    assert field in [error["field"] for error in response.json()["detail"]]
    assert queue_size(trainer_client) == 0


@pytest.mark.parametrize("text", ['{"tokens": [[1]', "not json", '{"tokens": [[1]],}', ""])
def test_malformed_json_is_refused_naming_the_body(trainer_client, text):
    response = _post_raw(trainer_client, text)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["field"] == "body"
    assert queue_size(trainer_client) == 0


def test_invalid_utf8_body_is_refused_not_crashing(trainer_client):
    response = trainer_client.post("/scored_data", content=b'{"tokens": "\xff\xfe"}',
                                   headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert trainer_client.get("/status").status_code == 200


def test_unknown_env_id_is_404_naming_env_id(trainer_client):
    response = trainer_client.post("/scored_data", json=make_group(2, env_id=7))
    assert response.status_code == 404
    assert "env_id=7" in response.json()["detail"]
    assert queue_size(trainer_client) == 0


def test_scored_data_before_trainer_registers_is_409(client):
    response = client.post("/scored_data", json=make_group(2))
    assert response.status_code == 409
    assert "POST /register" in response.json()["detail"]
    assert queue_size(client) == 0


def test_list_with_one_bad_group_stores_nothing_and_names_its_index(trainer_client):
    groups = [make_group(2, tag=1), make_group(2, tag=2), _with(masks=[[-100, 1, 1]] * 3)]
    response = trainer_client.post("/scored_data_list", json=groups)
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == "[2].masks"
    assert queue_size(trainer_client) == 0


def test_list_with_unknown_env_names_its_index(trainer_client):
    groups = [make_group(2), make_group(2, env_id=3)]
    response = trainer_client.post("/scored_data_list", json=groups)
    assert response.status_code == 404
    assert "[1].env_id=3" in response.json()["detail"]
    assert queue_size(trainer_client) == 0


def test_list_with_a_type_error_names_its_index(trainer_client):
    groups = [make_group(2), {**make_group(2), "scores": ["x", 1.0]}]
    response = trainer_client.post("/scored_data_list", json=groups)
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == "[1].scores[0]"
    assert queue_size(trainer_client) == 0


def test_empty_optional_lists_are_accepted_like_atropos_sends_them(trainer_client):
    group = make_group(3, advantages=[], ref_logprobs=[], inference_logprobs=[], messages=[],
                       overrides=[], group_overrides={}, images=[])
    response = trainer_client.post("/scored_data", json=group)
    assert response.json() == {"status": "received"}


def test_routed_experts_of_the_right_shape_are_accepted_and_served_as_sent(trainer_client):
    group = _with(routed_experts=[_routes(), _routes(dtype="uint16"), _routes(), _routes()])
    assert trainer_client.post("/scored_data", json=group).json() == {"status": "received"}
    served = trainer_client.get("/batch").json()["batch"]
    assert served is None or served[0]["routed_experts"] == group["routed_experts"]
    assert trainer_client.post("/scored_data", json=_with(routed_experts=None)).json() == {"status": "received"}


def test_routes_one_position_short_say_what_to_send(trainer_client):
    response = trainer_client.post("/scored_data", json=_with(routed_experts=[_routes(1)] * 4))
    assert response.json()["detail"][0]["msg"] == (
        "routed_experts[0].data: holds 1 positions of 2 layers x 2 uint8 expert ids but tokens[0] has 3 tokens; "
        "send one position per token but the last")


def test_distill_mismatch_says_what_to_send(trainer_client):
    response = trainer_client.post("/scored_data", json=BAD_GROUPS["distill_top_k_differs"][0])
    assert response.json()["detail"][0]["msg"] == (
        "distill_logprobs[0][1]: has 1 logprobs but distill_token_ids[0][1] has 2 token ids; "
        "send one logprob per token id")
    response = trainer_client.post("/scored_data", json=BAD_GROUPS["distill_logprobs_missing"][0])
    assert "send both (shape [sequence][position][top_k]) or neither" in response.json()["detail"][0]["msg"]


def test_distill_fields_of_matching_shape_are_accepted_with_top_k_varying_by_position(trainer_client):
    group = _with(distill_token_ids=[[[7], [8, 9], [10, 11, 12]]] * 4,
                  distill_logprobs=[[[-0.1], [-0.2, -0.3], [-0.4, -0.5, -0.6]]] * 4)
    response = trainer_client.post("/scored_data", json=group)
    assert response.json() == {"status": "received"}


def test_messages_with_role_content_and_extra_keys_are_accepted(trainer_client):
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reward": 1.0}]
    response = trainer_client.post("/scored_data", json=_with(messages=[conversation] * 4))
    assert response.json() == {"status": "received"}


def test_error_detail_does_not_echo_the_posted_body(trainer_client):
    group = _with(masks=[[-100, 1, 1]] * 3, messages=[[{"role": "user", "content": "secret-ish"}]])
    response = trainer_client.post("/scored_data", json=group)
    assert response.status_code == 422
    assert "secret-ish" not in response.text
    assert "input" not in response.json()["detail"][0]


def test_registration_with_bad_batch_size_names_the_field(client):
    response = client.post("/register", json={"batch_size": 0, "max_token_len": 16, "num_steps": 1})
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == "batch_size"
    assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}


def test_re_registering_with_a_smaller_batch_size_tightens_validation(client):
    register_trainer(client, batch_size=8)
    assert client.post("/scored_data", json=make_group(6)).status_code == 200
    register_trainer(client, batch_size=4)
    response = client.post("/scored_data", json=make_group(6))
    assert response.status_code == 422
    assert "batch_size is 4" in response.json()["detail"][0]["msg"]
    assert json.loads(client.get("/status").text)["queue_size"] == 1
