"""Which weights version produced each sampled token (single-copy mode).

The trainer writes vLLM's weights in place while requests run, so one completion may span several
versions. The worker knows each step's version exactly (it holds the weights gate from the step's
start to its end, vllm_patching.gate) and tags the step's output with it; the scheduler, which turns
each step's output into per-request outputs, keeps every request's versions as run lengths
``[[version, tokens], ...]`` and sends the whole list with each of the request's outputs, in
``kv_transfer_params["onecopy_weights_versions"]`` (vLLM carries that field from the engine to the
API server and into each RequestOutput; nothing else reads it without a KV connector). A later
output always holds the earlier ones' tokens, so outputs merged on the way (FINAL_ONLY, a slow
reader of deltas) lose nothing; a completion cut at a stop string by the API server holds no more
tokens than its list counts. /generate returns them per completion (``weight_versions``).

What "produced" means: the weights the step that sampled the token ran with. The KV of earlier
positions may come from older weights (a running request keeps its cache across a write); the
rollout logprob of each token is the one of its own step's weights, so the trainer's importance
weight for that token is exact.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.onecopy.token_versions")  # under "vllm" to use its log handler

OUTPUT_ATTRIBUTE = "onecopy_weights_version"  # on a ModelRunnerOutput: the version its step ran with
KEY = "onecopy_weights_versions"  # in an output's kv_transfer_params: run lengths [[version, tokens], ...]


def tag_step_output(output, version: int):
    """Worker side: mark ``output`` (a ModelRunnerOutput, an async one, or None) with its step's version.
    Pickled to the scheduler with the output (an instance attribute travels with it)."""
    if output is None:
        return output
    if hasattr(output, "get_output") and not hasattr(output, "sampled_token_ids"):  # AsyncModelRunnerOutput
        resolve = output.get_output
        output.get_output = lambda: tag_step_output(resolve(), version)
        return output
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

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        version = getattr(model_runner_output, OUTPUT_ATTRIBUTE, None)
        if version is None:  # a step the gate did not run (vLLM's own warm-up)
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
