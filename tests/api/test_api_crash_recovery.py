"""The real server process, killed with SIGKILL and restarted on the same database file.

Every group acknowledged with 2xx must be served exactly once across all restarts.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from api_testlib import make_group

pytestmark = pytest.mark.e2e

SIZES = (1, 3, 2, 2, 4)  # tag % 5 picks one; every 5 consecutive tags fill 3 batches of 4


def _register(url: str, batch_size: int = 4) -> None:
    body = {"batch_size": batch_size, "max_token_len": 16, "num_steps": 100}
    requests.post(url + "/register", json=body, timeout=5).raise_for_status()


def _post(url: str, tag: int, size: int | None = None, session: requests.Session | None = None) -> str:
    size = SIZES[tag % len(SIZES)] if size is None else size
    group = make_group(size, tag=tag, group_uuid=f"g{tag}")
    response = (session or requests).post(url + "/scored_data", json=group, timeout=5)
    response.raise_for_status()
    return response.json()["status"]


def _pull_one(url: str, batch_size: int = 4) -> list[int] | None:
    batch = requests.get(url + "/batch", timeout=5).json()["batch"]
    if batch is None:
        return None
    assert sum(len(group["tokens"]) for group in batch) == batch_size
    return [group["tokens"][0][0] for group in batch]


def _drain(url: str, batch_size: int = 4) -> list[int]:
    served = []
    while (tags := _pull_one(url, batch_size)) is not None:
        served.extend(tags)
    return served


def _status(url: str) -> dict:
    return requests.get(url + "/status", timeout=5).json()


def test_kill_after_posting_loses_no_acknowledged_group(tmp_path, launch_api):
    db = tmp_path / "api.db"
    server = launch_api(db)
    _register(server.url)
    tags = range(1, 31)
    assert all(_post(server.url, tag) == "received" for tag in tags)
    server.kill_hard()

    server = launch_api(db)
    status = _status(server.url)
    assert (status["current_step"], status["queue_size"], status["queued_sequences"]) == (
        0, 30, sum(SIZES[tag % len(SIZES)] for tag in tags))
    assert _post(server.url, 7) == "duplicate"
    served = _drain(server.url)
    assert sorted(served) == list(tags)
    assert "[API] served batch step=" in server.log()


def test_kill_between_batches_serves_no_group_twice(tmp_path, launch_api):
    db = tmp_path / "api.db"
    server = launch_api(db)
    _register(server.url)
    tags = range(1, 21)
    for tag in tags:
        _post(server.url, tag)
    served = []
    for kill_round in range(3):
        for _ in range(2):
            served.extend(_pull_one(server.url))
        server.kill_hard()
        server = launch_api(db)
        assert _status(server.url)["current_step"] == 2 * (kill_round + 1)
        assert _status(server.url)["queue_size"] == 20 - len(served)
    served.extend(_drain(server.url))
    assert sorted(served) == list(tags)
    assert all(_post(server.url, tag) == "duplicate" for tag in tags)


def test_kill_while_posting_keeps_every_acknowledged_group_and_retries_dedupe(tmp_path, launch_api):
    db = tmp_path / "api.db"
    server = launch_api(db)
    _register(server.url, batch_size=2)
    acknowledged: list[int] = []
    halfway = threading.Event()

    def killer() -> None:
        halfway.wait(timeout=30)
        server.kill_hard()

    thread = threading.Thread(target=killer)
    thread.start()
    tag = 0
    with requests.Session() as session:
        while True:
            tag += 1
            try:
                _post(server.url, tag, size=2, session=session)
            except requests.RequestException:
                break
            acknowledged.append(tag)
            if tag == 25:
                halfway.set()
    thread.join()
    attempted = set(range(1, tag + 1))

    server = launch_api(db)
    before = _drain(server.url, batch_size=2)
    assert set(acknowledged) <= set(before) <= attempted
    for retry in sorted(attempted):  # the environment retries what it is unsure about
        expected = "duplicate" if retry in before else "received"
        assert _post(server.url, retry, size=2) == expected
    after = _drain(server.url, batch_size=2)
    assert sorted(before + after) == sorted(attempted)


def test_concurrent_posts_and_pulls_serve_each_group_once(tmp_path, launch_api):
    server = launch_api(tmp_path / "api.db")
    _register(server.url)
    tags = range(1, 101)
    served: list[int] = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        posts = pool.map(lambda tag: _post(server.url, tag, size=2), tags)
        pulls = [pool.submit(_pull_one, server.url) for _ in range(20)]
        assert set(posts) == {"received"}
        for pull in pulls:
            served.extend(pull.result() or [])
    served.extend(_drain(server.url))
    assert sorted(served) == list(tags)


def test_api_key_is_enforced_by_the_real_server(tmp_path, launch_api):
    server = launch_api(tmp_path / "api.db", api_key="k3y")
    assert requests.get(server.url + "/status", timeout=5).status_code == 401
    headers = {"Authorization": "Bearer k3y"}
    assert requests.get(server.url + "/status", headers=headers, timeout=5).status_code == 200
