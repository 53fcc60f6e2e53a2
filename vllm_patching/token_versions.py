"""Which weights version produced each sampled token (single-copy mode).

The trainer writes vLLM's weights in place while requests run, so one completion may span several
versions. The worker knows each step's version exactly (it holds the weights gate from the step's
start to its end, vllm_patching.gate) and tags the step's output with it: an attribute of the
``ModelRunnerOutput``, which reaches the scheduler as the same object (one process) or pickled
(vLLM's multiprocess executor), either way with the attribute. The scheduler, which turns each
step's output into per-request outputs, keeps every request's versions as run lengths
``[[version, tokens], ...]`` and sends the whole list with each of the request's outputs, in
``kv_transfer_params["onecopy_weights_versions"]`` (vLLM carries that field from the engine to the
API server and into each RequestOutput; nothing else reads it without a KV connector). A later
output always holds the earlier ones' tokens, so outputs merged on the way (FINAL_ONLY, a slow
reader of deltas) lose nothing; a completion cut at a stop string by the API server holds no more
tokens than its list counts. /generate returns them per completion (``weight_versions``).

What "produced" means: the weights the step that sampled the token ran with. The KV of earlier
positions may come from older weights (a running request keeps its cache across a write); the
rollout logprob of each token is the one of its own step's weights, so the trainer's importance
weight for that token is exact. The tag is taken in the worker, not from the gate's record when
the scheduler plans the step: the trainer may write between the two.

Which object to tag: a step may answer with an ``AsyncModelRunnerOutput`` (always with Model Runner
V2, vLLM's default on CUDA for dense models; with async scheduling on the V1 runner) that vLLM's
executors resolve with ``get_output()`` into *another* object, the ``ModelRunnerOutput`` the
scheduler sees. So the version goes on what ``get_output()`` returns, and the two are told apart
by vLLM's own base class, as its executors do (V2's async output has a ``sampled_token_ids`` of its
own, a host copy in flight, so no attribute test tells them apart). A step output of any other type
is refused rather than tagged where nothing reads it, and the scheduler logs an error if a step with
sampled tokens comes without a version.
"""

from __future__ import annotations

import logging

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

logger = logging.getLogger("vllm.onecopy.token_versions")  # under "vllm" to use its log handler

OUTPUT_ATTRIBUTE = "onecopy_weights_version"  # on a ModelRunnerOutput: the version its step ran with
KEY = "onecopy_weights_versions"  # in an output's kv_transfer_params: run lengths [[version, tokens], ...]


def tag_step_output(output, version: int):
    """Worker side: mark ``output`` (a ModelRunnerOutput, an AsyncModelRunnerOutput, or None) with its
    step's version; an async output marks the ModelRunnerOutput it resolves to."""
    if output is None:
        return output
    if isinstance(output, AsyncModelRunnerOutput):
        resolve = output.get_output  # called once, by the executor (vllm/v1/executor/*_executor.py)
        output.get_output = lambda: tag_step_output(resolve(), version)
        return output
    if not isinstance(output, ModelRunnerOutput):
        raise TypeError(f"the worker's step returned a {type(output).__name__}, neither vLLM's ModelRunnerOutput "
                        "nor an AsyncModelRunnerOutput: this vLLM is not one vllm_patching.token_versions knows")
    setattr(output, OUTPUT_ATTRIBUTE, version)
    return output


def add_run(runs: list[list[int]], version: int, tokens: int) -> None:
    """Append ``tokens`` tokens of ``version`` to run lengths ``runs`` (in place)."""
    if runs and runs[-1][0] == version:
        runs[-1][1] += tokens
    else:
        runs.append([version, tokens])


def expand(runs: list[list[int]] | None, tokens: int) -> list[int] | None:
    """One version per token from run lengths, cut to the ``tokens`` the completion kept (None: unknown)."""
    if runs is None:
        return None
    versions = [version for version, count in runs for _ in range(count)]
    if len(versions) < tokens:
        raise ValueError(f"weights versions for {len(versions)} tokens but the completion has {tokens}")
    return versions[:tokens]


class TokenVersions:
    """Mixin over vLLM's scheduler: each request's outputs carry the versions of its tokens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._onecopy_token_versions: dict[str, list[list[int]]] = {}
        self._onecopy_untagged_logged = False

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        version = getattr(model_runner_output, OUTPUT_ATTRIBUTE, None)
        if version is None:  # vLLM's warm-up steps stay in the worker: one here lost its tag on the way
            if not self._onecopy_untagged_logged and any(
                    out.new_token_ids for engine_outputs in outputs.values() for out in engine_outputs.outputs):
                self._onecopy_untagged_logged = True
                logger.error("[vLLM Patch] a step sampled tokens but its output (%s) carries no weights version: "
                             "/generate returns weight_versions null; the worker's tag did not reach the "
                             "scheduler (vllm_patching.token_versions.tag_step_output)",
                             type(model_runner_output).__name__)
            return outputs
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if not out.new_token_ids:
                    continue
                runs = self._onecopy_token_versions.setdefault(out.request_id, [])
                add_run(runs, version, len(out.new_token_ids))
                out.kv_transfer_params = {**(out.kv_transfer_params or {}), KEY: [list(run) for run in runs]}
        for request_id in [r for r in self._onecopy_token_versions if r not in self.requests]:
            del self._onecopy_token_versions[request_id]  # finished or aborted
        return outputs
