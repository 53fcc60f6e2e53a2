"""Each token's weights version: the worker tags its step's output, the scheduler keeps every
request's versions as run lengths, /generate expands them per completion (the engine end to end:
tests/integration/test_shared_vllm_cpu.py)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from vllm_patching.token_versions import KEY, OUTPUT_ATTRIBUTE, TokenVersions, add_run, expand, tag_step_output


def test_run_lengths_grow_and_expand_to_one_version_per_kept_token():
    runs: list[list[int]] = []
    for version, tokens in [(3, 1), (3, 2), (4, 1), (6, 2)]:
        add_run(runs, version, tokens)
    assert runs == [[3, 3], [4, 1], [6, 2]]
    assert expand(runs, 6) == [3, 3, 3, 4, 6, 6]
    assert expand(runs, 4) == [3, 3, 3, 4]  # cut at a stop string by the API server
    assert expand(None, 4) is None
    with pytest.raises(ValueError, match="versions for 6 tokens but the completion has 7"):
        expand(runs, 7)


class Output:
    """A ModelRunnerOutput stand-in: a plain picklable object."""

    sampled_token_ids = [[1]]


class AsyncOutput:
    def __init__(self, result):
        self.result = result

    def get_output(self):
        return self.result


def test_the_step_version_travels_with_the_output_and_with_an_async_output_once_resolved():
    tagged = pickle.loads(pickle.dumps(tag_step_output(Output(), 7)))  # as the worker sends it to the scheduler
    assert getattr(tagged, OUTPUT_ATTRIBUTE) == 7
    assert getattr(tag_step_output(AsyncOutput(Output()), 8).get_output(), OUTPUT_ATTRIBUTE) == 8
    assert tag_step_output(None, 1) is None


class FakeScheduler:
    """What TokenVersions needs of vLLM's scheduler: update_from_output's per-client outputs and the live requests."""

    def __init__(self):
        self.requests, self.steps = {}, []

    def update_from_output(self, scheduler_output, model_runner_output):
        return {0: SimpleNamespace(outputs=self.steps.pop(0))}


class Scheduler(TokenVersions, FakeScheduler):
    pass


def out(request_id, tokens, params=None):
    return SimpleNamespace(request_id=request_id, new_token_ids=tokens, kv_transfer_params=params)


def test_each_output_carries_all_its_requests_versions_so_far_and_finished_requests_are_forgotten():
    scheduler = Scheduler()
    scheduler.requests = {"a": 1, "b": 1}
    first = [out("a", [11]), out("b", [])]  # b still prefilling
    second = [out("a", [12, 13], {"other": 1}), out("b", [21])]
    scheduler.steps = [first, second]
    scheduler.update_from_output(None, SimpleNamespace(**{OUTPUT_ATTRIBUTE: 4}))
    assert first[0].kv_transfer_params == {KEY: [[4, 1]]} and first[1].kv_transfer_params is None
    del scheduler.requests["b"]  # finished in the second step
    scheduler.update_from_output(None, SimpleNamespace(**{OUTPUT_ATTRIBUTE: 5}))
    assert second[0].kv_transfer_params == {"other": 1, KEY: [[4, 1], [5, 2]]}
    assert second[1].kv_transfer_params == {KEY: [[5, 1]]}
    assert set(scheduler._onecopy_token_versions) == {"a"}


def test_steps_without_a_version_leave_the_outputs_alone():
    scheduler = Scheduler()
    untouched = [out("a", [1])]
    scheduler.steps = [untouched]
    scheduler.update_from_output(None, SimpleNamespace())
    assert untouched[0].kv_transfer_params is None
