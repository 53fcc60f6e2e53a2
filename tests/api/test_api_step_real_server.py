"""The trainer's filtered batches against the real API server: a step that fetched more batches
after stale groups were dropped counts once in the step the environments follow."""

from __future__ import annotations

import requests
from api_testlib import make_group

from example_trainer.data.api_client import TrajectoryClient
from example_trainer.data.group_filters import FilteredBatches, staleness_rule


def test_a_step_refilled_after_dropping_stale_groups_counts_once_in_the_apis_step(tmp_path, launch_api):
    server = launch_api(tmp_path / "api.db")
    client = TrajectoryClient(server.url)
    batches = FilteredBatches(client, batch_size=2, max_batches=5, rules=[staleness_rule(lambda: 10, 2)])
    batches.register(2, 16, 3)
    stale = [[-1, 1, 1]] * 2  # sampled at version 1, 9 versions behind the trainer's 10
    fresh = [[-1, 9, 9]] * 2
    for tag, versions in enumerate((stale, stale, fresh), start=1):
        assert requests.post(server.url + "/scored_data", json=make_group(2, tag=tag, weight_versions=versions),
                             timeout=5).status_code == 200
    batch = batches.get_batch(timeout=10)
    assert [group.tokens[0][0] for group in batch] == [3]  # the fresh group, after two stale batches
    assert requests.get(server.url + "/status", timeout=5).json() == {
        "current_step": 1, "queue_size": 0, "queued_sequences": 0, "batch_ready": False}


def test_a_trainer_whose_environments_drop_every_group_says_why_and_stops(tmp_path, launch_api, monkeypatch, caplog):
    """Seen with a tiny random model: the environment dropped 918 groups in 8 minutes (every score
    0.0), said so only in its own log, and the trainer logged "waiting for a batch" until killed."""
    import logging

    import pytest

    from example_trainer.data import api_client

    monkeypatch.setattr(api_client, "DROPS_REPORT_SECONDS", 0.05)
    monkeypatch.setattr(api_client, "NOTHING_KEPT_STOP_SECONDS", 0.3)
    server = launch_api(tmp_path / "api.db")
    client = TrajectoryClient(server.url)
    client.register(batch_size=2, max_token_len=16, num_steps=3)
    env_id = requests.post(server.url + "/register-env", json={"max_token_length": 16, "desired_name": "e",
                                                               "weight": 1.0, "group_size": 2}, timeout=5).json()["env_id"]
    made = iter(range(1, 10**6))

    def environment_drops_a_group():  # what an environment reports after each group it drops
        requests.post(server.url + "/env-dropped", json={"env_id": env_id, "counts": {"dropped_equal_scores": next(made)}},
                      timeout=5).raise_for_status()

    with caplog.at_level(logging.INFO, logger="onecopy.trainer.api"), \
            pytest.raises(api_client.NothingKept, match="dropped all [0-9]+ groups they made") as stopped:
        client.get_batch(timeout=120, while_waiting=environment_drops_a_group)
    assert "--env.ensure_scores_are_not_same false" in str(stopped.value)
    assert "groups meanwhile; " in caplog.text and "dropped_equal_scores (every completion of a group scored" in caplog.text
