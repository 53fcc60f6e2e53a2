"""Where the trainer's batches come from: the trajectory API (``TrajectoryClient``: environments
run as their own processes and post scored groups), or an environment inside this process that
samples from the in-process engine (``InProcessRollouts``, mode colocate).

Both answer ``register(...)`` once and ``get_batch(timeout, while_waiting)`` per step, returning
``--batch-size`` sequences as typed groups; ``count_step()`` counts a step where a filter
(``group_filters.FilteredBatches``) fetched its batches with ``count_step=False``. Several ranks:
rank 0 alone takes the batches and hands the others theirs, so the other ranks have no source.
The loop takes each step's batch from ``TrainBatches``, which does that on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from api.models import ScoredData
from example_trainer.config import TrainerConfig
from example_trainer.data.api_client import TrajectoryClient
from example_trainer.data.batching import TrainBatch, build_batch, refuse_truncated_sampling
from example_trainer.data.group_filters import FilteredBatches, signal_rule, staleness_rule
from example_trainer.data.inprocess_rollouts import InProcessRollouts, load_environment
from example_trainer.parallel import Parallel


class BatchSource(Protocol):
    def register(self, batch_size: int, max_token_len: int, num_steps: int, **info) -> dict:
        """Announce the trainer (batch size, longest sequence, steps); once, before the first batch."""

    def get_batch(self, timeout: float, while_waiting: Callable[[], None] = ..., count_step: bool = True
                  ) -> list[ScoredData]:
        """The next ``batch_size`` sequences as whole groups; ``while_waiting`` is called while none is ready.
        ``count_step=False``: this batch is not a step of its own (a filter may fetch several for one)."""

    def count_step(self) -> None:
        """Count one step where the batches are served (after fetches with ``count_step=False``)."""

    def step_metrics(self) -> dict[str, float]:
        """What the source did for the last batch (logged with the step's metrics)."""


def open_batch_source(cfg: TrainerConfig, in_process: bool, engine, tokenizer, parallel: Parallel,
                      start_step: int, run_dir: str, current_version=lambda: None,
                      end_tokens: set[int] | None = None) -> BatchSource | None:
    """This rank's batch source, registered (None on ranks other than 0). ``current_version()``:
    the weights version vLLM serves now (single copy), for ``--max-off-policy-steps``;
    ``end_tokens``: those of ``--mask-truncated-completions`` (dynamic sampling looks past the
    completions the loss masks)."""
    if in_process:  # colocate: the environment samples from the engine here, no API
        env = load_environment(cfg.environment, cfg.env_args, cfg.seq_len, tokenizer, engine)
        source = InProcessRollouts(env, cfg.batch_size, engine if cfg.release_kv_cache else None)
    elif parallel.is_main:
        source = TrajectoryClient(cfg.api_url, cfg.api_key)
    else:
        return None
    # Staleness first: it masks tokens past the bound, and the signal rule then judges what is left.
    rules = ([staleness_rule(current_version, cfg.max_off_policy_steps)] if cfg.max_off_policy_steps is not None
             else []) + ([signal_rule(end_tokens)] if cfg.dynamic_sampling else [])
    if rules:
        source = FilteredBatches(source, cfg.batch_size, cfg.max_batches_per_step, rules)
    source.register(cfg.batch_size, cfg.seq_len, cfg.max_steps, starting_step=start_step,
                    checkpoint_dir=run_dir, wandb_project=cfg.wandb_project, wandb_group=cfg.wandb_group)
    return source


class TrainBatches:
    """Each step's batch, as every rank trains on it: rank 0 takes the groups from its ``source``
    (the filters of --dynamic-sampling and --max-off-policy-steps inside it), refuses what the loss
    cannot use and pads them into a ``TrainBatch``; every rank gets that whole batch (data
    parallel: each trains its share of the rows, ``Parallel.my_rows``)."""

    def __init__(self, source: BatchSource | None, cfg: TrainerConfig, parallel: Parallel,
                 end_tokens: set[int] | None = None) -> None:
        self.source = source  # None on ranks other than 0
        self.cfg = cfg
        self.parallel = parallel
        self.end_tokens = end_tokens  # --mask-truncated-completions

    def next(self, while_waiting: Callable[[], None]) -> TrainBatch:
        """The next batch; ``while_waiting`` is called while rank 0 waits for one."""
        cfg, batch = self.cfg, None
        if self.source is not None:
            groups = self.source.get_batch(cfg.batch_wait_timeout, while_waiting=while_waiting)
            if cfg.vllm_importance_sampling_correction:
                refuse_truncated_sampling(groups)
            batch = build_batch(groups, cfg.seq_len, cfg.scale_rewards, self.end_tokens, cfg.routing_replay)
        return self.parallel.share(batch)

    def step_metrics(self) -> dict[str, float]:
        """What the source did for the last batch (rank 0's; none elsewhere)."""
        return self.source.step_metrics() if self.source is not None else {}
