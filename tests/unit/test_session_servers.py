"""The session vLLM servers of tests/conftest.py stop after the last test that uses them, not at the
session's end (with all of them alive beside a CI lane's e2e loop, memory ran low)."""

from __future__ import annotations

from types import SimpleNamespace

from tests import conftest


class FakeServer:
    def __init__(self):
        self.stops = 0

    def stop(self):
        self.stops += 1


def test_each_session_server_stops_after_its_last_user_and_no_sooner(monkeypatch):
    shared, lora = FakeServer(), FakeServer()
    monkeypatch.setattr(conftest, "RUNNING_SESSION_SERVERS", [shared, lora])
    monkeypatch.setattr(conftest, "LAST_USERS", {})
    uses = {"a": {"vllm_shared_server": shared}, "b": {"vllm_lora_server": lora}, "c": {"vllm_shared_server": shared},
            "d": {}}
    items = [SimpleNamespace(nodeid=name, fixturenames=list(funcargs), funcargs=funcargs)
             for name, funcargs in uses.items()]
    conftest.pytest_collection_finish(SimpleNamespace(items=items))
    stops_after_each = []
    for item, nextitem in zip(items, items[1:] + [None]):
        conftest.pytest_runtest_teardown(item, nextitem)
        stops_after_each.append((shared.stops, lora.stops))
    # lora's last user is b, shared's is c; d uses none; each is stopped once.
    assert stops_after_each == [(0, 0), (0, 1), (1, 1), (1, 1)]
    assert conftest.RUNNING_SESSION_SERVERS == []
