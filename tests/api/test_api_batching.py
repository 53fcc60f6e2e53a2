"""Batches hold exactly batch_size sequences, never split a group, and prefer the oldest groups."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
from api_testlib import make_group, queue_size, register_trainer
from fastapi.testclient import TestClient

from api.app import create_app
from api.batching import pick_exact
from api.settings import ApiSettings


def _first_exact_subset(sizes: list[int], target: int) -> list[int] | None:
    """Brute force: of all index subsets summing to target, the lexicographically smallest."""
    best = None
    for count in range(1, len(sizes) + 1):
        for subset in itertools.combinations(range(len(sizes)), count):
            if sum(sizes[i] for i in subset) == target and (best is None or list(subset) < best):
                best = list(subset)
    return best


def test_pick_exact_serves_groups_that_sum_to_target_skipping_ones_that_cannot():
    assert pick_exact([3, 3, 2, 2], 4) == [2, 3]
    assert pick_exact([3, 3, 2], 4) is None
    assert pick_exact([3, 2, 1, 2], 4) == [0, 2]
    assert pick_exact([5, 4], 4) == [1]
    assert pick_exact([], 4) is None


def test_pick_exact_matches_brute_force_on_random_queues():
    rng = random.Random(1234)
    for _ in range(400):
        target = rng.randint(1, 12)
        sizes = [rng.randint(1, target + 2) for _ in range(rng.randint(0, 10))]
        assert pick_exact(sizes, target) == _first_exact_subset(sizes, target), (sizes, target)


def test_pick_exact_rejects_a_target_below_one():
    with pytest.raises(ValueError, match="target=0"):
        pick_exact([1], 0)


def _served_groups(client) -> list[list[dict]]:
    batches = []
    while (batch := client.get("/batch").json()["batch"]) is not None:
        batches.append(batch)
    return batches


def test_batch_is_null_when_groups_cannot_fill_it(client):
    register_trainer(client, batch_size=4)
    for size in (3, 3):
        client.post("/scored_data", json=make_group(size))
    assert client.get("/batch").json() == {"batch": None}
    # 6 rows, more than a batch, yet no batch: an environment reads this and does not wait on them.
    assert client.get("/status").json() == {"current_step": 0, "queue_size": 2, "queued_sequences": 6,
                                            "batch_ready": False}
    client.post("/scored_data", json=make_group(1))
    assert client.get("/status").json()["batch_ready"] is True
    assert len(client.get("/batch").json()["batch"]) == 2


def test_a_queue_that_cannot_fill_a_batch_is_reported_once_a_while(tmp_path, caplog):
    # The trainer polls every 50 ms while it waits; each poll used to log the same warning.
    with TestClient(create_app(ApiSettings(db_path=str(tmp_path / "api.db"), api_key=None, batch_window=2))) as client:
        register_trainer(client, batch_size=4)
        for size in (3, 3):
            client.post("/scored_data", json=make_group(size))
        with caplog.at_level(logging.WARNING, logger="onecopy.api.store"):
            for _ in range(5):
                assert client.get("/batch").json() == {"batch": None}
    assert caplog.text.count("cannot add up to batch_size=4") == 1


def test_batch_never_splits_a_group_and_holds_exactly_batch_size(client):
    register_trainer(client, batch_size=4)
    for tag, size in enumerate((3, 3, 2, 2, 1), start=1):
        client.post("/scored_data", json=make_group(size, tag=tag))
    batch = client.get("/batch").json()["batch"]
    assert [group["tokens"][0][0] for group in batch] == [1, 5]
    assert sum(len(group["tokens"]) for group in batch) == 4


@pytest.mark.parametrize("seed", range(5))
def test_random_group_sizes_are_served_whole_exactly_once_in_exact_batches(client, seed):
    rng = random.Random(seed)
    batch_size = rng.choice([4, 6, 8])
    register_trainer(client, batch_size=batch_size)
    sizes = {tag: rng.randint(1, batch_size) for tag in range(1, 41)}
    for tag, size in sizes.items():
        assert client.post("/scored_data", json=make_group(size, tag=tag)).status_code == 200

    served: list[int] = []
    for batch in _served_groups(client):
        assert sum(len(group["tokens"]) for group in batch) == batch_size
        for group in batch:
            tag = group["tokens"][0][0]
            assert group["tokens"] == [[tag] * 3] * sizes[tag]
            served.append(tag)
        assert [group["tokens"][0][0] for group in batch] == sorted(
            group["tokens"][0][0] for group in batch)

    assert len(served) == len(set(served))
    left = [size for tag, size in sizes.items() if tag not in served]
    assert len(left) == queue_size(client)
    assert pick_exact(left, batch_size) is None


def test_oldest_group_is_served_first_when_it_can_be(client):
    register_trainer(client, batch_size=4)
    for tag, size in enumerate((2, 1, 3, 2), start=1):
        client.post("/scored_data", json=make_group(size, tag=tag))
    batch = client.get("/batch").json()["batch"]
    assert [group["tokens"][0][0] for group in batch] == [1, 4]


def test_batches_count_steps_from_starting_step(client):
    register_trainer(client, batch_size=2, starting_step=5)
    for _ in range(3):
        client.post("/scored_data", json=make_group(2))
    for _ in range(3):
        client.get("/batch")
    assert client.get("/status").json() == {"current_step": 8, "queue_size": 0, "queued_sequences": 0,
                                            "batch_ready": False}


def test_a_trainer_that_counts_its_own_steps_fetches_batches_without_counting_them(client):
    # A trainer that drops stale groups may fetch several batches for one step: environments stop at the API's step.
    register_trainer(client, batch_size=2, num_steps=2)
    for _ in range(3):
        client.post("/scored_data", json=make_group(2))
    for _ in range(2):
        assert client.get("/batch", params={"count_step": "false"}).json()["batch"]
    assert client.get("/status").json() == {"current_step": 0, "queue_size": 1, "queued_sequences": 2,
                                            "batch_ready": True}
    assert client.post("/step").json() == {"current_step": 1, "queue_size": 1}
    assert client.get("/batch").json()["batch"]  # an Atropos trainer's fetch counts, as before
    assert client.get("/status").json()["current_step"] == 2


def test_served_group_is_the_posted_group_with_atropos_field_names(trainer_client):
    posted = make_group(8, env_id=None, advantages=[[0.5] * 3] * 8,
                        messages=[[{"role": "user", "content": "hi"}]] * 8,
                        generation_params={"temperature": 0.7}, group_uuid="u1")
    trainer_client.post("/scored_data", json=posted)
    (served,) = trainer_client.get("/batch").json()["batch"]
    assert {key: served[key] for key in posted} == posted
    assert set(served) >= {"tokens", "masks", "scores", "advantages", "ref_logprobs",
                           "inference_logprobs", "messages", "overrides", "group_overrides",
                           "images", "generation_params", "env_id"}


def test_groups_too_big_for_a_smaller_re_registered_batch_wait_while_others_are_served(client):
    register_trainer(client, batch_size=8)
    client.post("/scored_data", json=make_group(6, tag=1))
    client.post("/scored_data", json=make_group(2, tag=2))
    client.post("/scored_data", json=make_group(2, tag=3))
    register_trainer(client, batch_size=4)
    batch = client.get("/batch").json()["batch"]
    assert [group["tokens"][0][0] for group in batch] == [2, 3]
    assert queue_size(client) == 1
    register_trainer(client, batch_size=6)
    assert client.get("/batch").json()["batch"][0]["tokens"][0][0] == 1


def test_every_field_of_atroposlibs_scored_data_comes_back_from_batch(client):
    atropos = pytest.importorskip("atroposlib.api.server",
                                  reason="test dependency: pip install -r requirements-test.txt")
    register_trainer(client, batch_size=2)
    env_id = client.post("/register-env", json={"max_token_length": 16}).json()["env_id"]
    group = atropos.ScoredData(
        tokens=[[1, 2, 3], [1, 2, 4]],
        masks=[[-100, 2, 3], [-100, 2, 4]],
        scores=[1.0, -1.0],
        advantages=[[0.0, 0.5, 0.5], [0.0, -0.5, -0.5]],
        ref_logprobs=[[0.0, -1.25, -2.5], [0.0, -1.5, -3.0]],
        messages=[[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reward": 1.0}],
                  [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5", "reward": -1.0}]],
        generation_params={"temperature": 0.7, "max_tokens": 2},
        inference_logprobs=[[1.0, -0.25, -0.75], [1.0, -0.5, -1.0]],
        overrides=[{"set_advantage_to_zero": True}, {}],
        group_overrides={"group_size": 2},
        images=["base64-image-a", "base64-image-b"],
        env_id=env_id,
        distill_token_ids=[[[0], [2, 9], [3, 8]], [[0], [2, 9], [4, 8]]],
        distill_logprobs=[[[0.0], [-0.1, -2.0], [-0.2, -3.0]], [[0.0], [-0.1, -2.0], [-0.3, -4.0]]],
    )
    posted = group.model_dump()
    # The test covers the whole model: a field added in a later atroposlib would fail here first.
    defaults = {name: field.get_default(call_default_factory=True) for name, field in type(group).model_fields.items()}
    assert [name for name, value in posted.items() if value == defaults[name]] == []

    assert client.post("/scored_data", json=posted).json() == {"status": "received"}
    (served,) = client.get("/batch").json()["batch"]
    assert {name: served[name] for name in posted} == posted
