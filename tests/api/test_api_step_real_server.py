"""The trainer's filtered batches against the real API server: a step that fetched more batches
after stale groups were dropped counts once in the step the environments follow."""

from __future__ import annotations

import requests
from api_testlib import make_group

from example_trainer.api_client import TrajectoryClient
from example_trainer.group_filters import FilteredBatches, staleness_rule


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
    assert requests.get(server.url + "/status", timeout=5).json() == {"current_step": 1, "queue_size": 0}
