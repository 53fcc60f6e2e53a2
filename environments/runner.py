"""How an environment runs: the `serve`, `process` and `evaluate` loops around its hooks.

    serve:    setup() -> register -> read the API's queue -> max_num_workers workers, each looping
              get_next_item() -> collect_trajectories() -> handle_send_to_api()
              beside a status poller (trainer step, API queue, periodic evaluate() and wandb_log())
              until total_steps groups are posted or the trainer reaches its num_steps
    process:  setup() -> the same workers, writing JSONL instead of posting (no API)
    evaluate: setup() -> evaluate() once

EnvRunner is given the environment and calls it only through RunnableEnv, below; BaseEnv
(environments/base.py) provides that interface and starts a runner from env_manager(),
process_manager() and run_evaluate().
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional, Protocol

from environments.clients import TrajectoryApiClient
from environments.config import BaseEnvConfig
from environments.run_state import RunState
from environments.schemas import ScoredDataGroup

logger = logging.getLogger("onecopy.env")
Item = Any


class RunnableEnv(Protocol):
    """What EnvRunner needs of an environment. BaseEnv's docstrings say what each hook does."""

    config: BaseEnvConfig
    run_state: RunState  # written by the runner, read and counted in by the hooks
    status_poll_s: float  # how often serve asks the API for the trainer step and queue
    room_poll_s: float  # how often a worker held back by max_batches_offpolicy asks for the queue
    register_poll_s: float  # how often a registering environment asks whether the trainer has started
    api: Optional[TrajectoryApiClient]  # set by open_clients(post_to_api=True)
    counts: dict[str, int]  # groups dropped or skipped, by reason (logged at the end)

    def open_clients(self, post_to_api: bool = False) -> None: ...

    async def close_clients(self) -> None: ...

    def init_wandb(self) -> None: ...

    async def setup(self) -> None: ...

    async def get_next_item(self) -> Optional[Item]: ...

    async def collect_trajectories(self, item: Item) -> tuple[Optional[ScoredDataGroup], list[Item]]: ...

    async def handle_send_to_api(
        self, group: ScoredDataGroup, item: Item = None, do_send_to_api: bool = True
    ) -> bool: ...

    async def evaluate(self) -> dict[str, float]: ...

    async def wandb_log(self, wandb_metrics: Optional[dict[str, float]] = None) -> dict[str, float]: ...


class EnvRunner:
    """One run of `env`; see the module docstring for the order of calls."""

    def __init__(self, env: RunnableEnv):
        self.env = env
        self.config = env.config
        self.state = env.run_state
        self.poll_s = env.status_poll_s
        self.room_poll_s = env.room_poll_s
        self.register_poll_s = env.register_poll_s
        self.backlog: list[Item] = []  # items collect_trajectories handed back, served first
        self.in_flight = 0  # groups the workers are generating and have not posted yet
        self.posted = 0  # groups this runner's workers have posted to the API
        self.posted_rows = 0  # the rows in them
        self._room_check = asyncio.Lock()

    async def _next(self) -> Optional[Item]:
        if self.backlog:
            return self.backlog.pop(0)
        return await self.env.get_next_item()

    def _has_room(self) -> bool:
        """Whether one more group may start: the rows queued at the API plus group_size rows per
        group in flight stay under max_batches_offpolicy batches, or none is in flight and the
        API says its queue cannot make a batch.

        Rows, not groups of group_size: a multi-turn group whose unscored episodes left it is
        shorter (one whose episodes forked, longer), and counted as group_size rows a queue of
        short groups filled the bound with less than a batch: the trainer waited for rows and the
        environment for room, forever. A group in flight counts group_size rows: its size is
        known once it is posted. The limit is at least one batch, so a queue that holds it holds
        a batch's rows; but a batch is groups adding up to exactly batch_size, and rows alone do
        not promise that (groups of 3 and 3 rows against batches of 4): when the API says no batch
        is ready, one group at a time goes out until one is.
        """
        state = self.state
        if not state.batch_size or not self.config.max_batches_offpolicy:
            return True
        limit = self.config.max_batches_offpolicy * state.batch_size
        if state.queued_rows + self.in_flight * self.config.group_size < limit:
            return True
        return self.in_flight == 0 and state.batch_ready is False

    async def _claim_room(self, bounded: bool) -> None:
        """Back-pressure: wait until queued plus in-flight groups leave room for one more (see
        _has_room), then count it in flight.

        Groups in flight count, so the bound holds however many workers run (counting only the
        queue let 8 workers overshoot a 1-batch bound by a batch, which the trainer's staleness
        bound then dropped). While waiting, the queue is read from the API every room_poll_s: the
        status poller's view is up to status_poll_s old, and vLLM would idle that long each step.
        """
        state = self.state
        async with self._room_check:  # one waiter asks the API; the others queue behind it
            logged = False
            while bounded and not self._has_room() and not (state.trainer_done() or state.quota_reached()):
                if not logged:
                    logger.info(
                        "[env] API queue holds %d groups (%d rows), %d in flight; waiting for the trainer",
                        state.queue_size,
                        state.queued_rows,
                        self.in_flight,
                    )
                    logged = True
                await asyncio.sleep(self.room_poll_s)
                await self._read_status()
            self.in_flight += 1  # before the lock is let go, so the next waiter counts this group

    async def _read_status(self) -> int:
        """Ask the API for the queue (kept in the run state) and return the trainer's step.

        A post that lands while the answer is on its way may be missing from it: posts that
        finished since the question are added, so the queue is never under-counted (at worst a
        group is counted twice until the next read), and whether a batch is ready is then unknown.
        An API that reports no rows (Atropos's) has its groups counted as group_size rows each."""
        state = self.state
        posted_before, rows_before = self.posted, self.posted_rows
        status = await self.env.api.status()
        late_groups, late_rows = self.posted - posted_before, self.posted_rows - rows_before
        rows = status.get("queued_sequences")
        if rows is None:
            rows = status["queue_size"] * self.config.group_size
        state.queue_size = status["queue_size"] + late_groups
        state.queued_rows = rows + late_rows
        state.batch_ready = None if late_groups else status.get("batch_ready")
        return status["current_step"]

    def _count_posted(self, rows: int) -> None:
        """A group of `rows` rows is queued now; the next status read confirms it. It may complete
        a batch, so whether one is ready is unknown until then."""
        self.posted += 1
        self.posted_rows += rows
        self.state.queue_size += 1
        self.state.queued_rows += rows
        self.state.batch_ready = None

    async def _worker(self, do_send_to_api: bool) -> None:
        while not (self.state.quota_reached() or self.state.trainer_done()):
            await self._claim_room(bounded=do_send_to_api)
            try:
                if self.state.quota_reached() or self.state.trainer_done():  # while this worker waited
                    return
                item = await self._next()
                if item is None:
                    logger.info("[env] no more items")
                    return
                group, backlog = await self.env.collect_trajectories(item)
                self.backlog.extend(backlog)
                posted = group is not None and await self.env.handle_send_to_api(group, item, do_send_to_api)
                if posted and do_send_to_api:
                    self._count_posted(len(group.tokens))
            finally:
                self.in_flight -= 1

    async def _run_workers(self, do_send_to_api: bool, *others: asyncio.Task) -> None:
        """Run max_num_workers workers until they finish or one of `others` ends; any error stops all."""
        workers = asyncio.gather(*(self._worker(do_send_to_api) for _ in range(self.config.max_num_workers)))
        try:
            done, _ = await asyncio.wait({workers, *others}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raises the first error
        finally:
            for task in (workers, *others):
                task.cancel()
            await asyncio.gather(workers, *others, return_exceptions=True)

    async def register(self) -> None:
        """Register with the API (waiting for the trainer) and read the trainer's settings."""
        state, api = self.state, self.env.api
        reg = await api.register_env(
            {
                "max_token_length": self.config.max_token_length,
                "desired_name": state.wandb_name,
                "weight": self.config.inference_weight,
                "group_size": self.config.group_size,
            },
            poll_s=self.register_poll_s,
        )
        state.env_id = reg["env_id"]
        state.curr_step = reg.get("starting_step") or 0
        num_steps = reg.get("num_steps")
        state.num_steps = num_steps if num_steps and num_steps > 0 else None
        info = await api.info()
        if state.batch_size is None and info.get("batch_size", -1) > 0:
            state.batch_size = info["batch_size"]
        trainer_max = info.get("max_token_len", -1)
        if trainer_max > 0 and trainer_max < state.max_token_length:
            logger.info("[env] trainer accepts %d tokens: using that as max_token_length", trainer_max)
            state.max_token_length = trainer_max
        if state.batch_size is not None and self.config.group_size > state.batch_size:
            raise ValueError(
                f"--env.group_size {self.config.group_size} is larger than the trainer's "
                f"batch_size {state.batch_size}: a group must fit in one batch"
            )
        logger.info(
            "[env] registered env_id=%s name=%s step=%d num_steps=%s batch_size=%s",
            state.env_id,
            reg.get("wandb_name"),
            state.curr_step,
            state.num_steps,
            state.batch_size,
        )
        state.wandb_name = reg.get("wandb_name") or state.wandb_name

    async def _poll_status(self) -> None:
        """Serve only: follow the trainer's step and queue; evaluate and log as steps go by."""
        state = self.state
        eval_task: Optional[asyncio.Task] = None
        last_eval = state.curr_step
        every = self.config.steps_per_eval
        try:
            while not state.trainer_done():
                await asyncio.sleep(self.poll_s)
                step = await self._read_status()
                if eval_task is not None and eval_task.done():
                    eval_task.result()  # surfaces an exception raised during evaluation
                    eval_task = None
                if step == state.curr_step:
                    continue
                state.curr_step = step
                if every and step // every > last_eval // every and eval_task is None:
                    last_eval = step
                    eval_task = asyncio.create_task(self.env.evaluate())
                await self.env.wandb_log()
            logger.info("[env] trainer reached num_steps=%s; stopping", state.num_steps)
        finally:
            if eval_task is not None:
                eval_task.cancel()

    async def serve(self) -> None:
        """`serve`: post groups to the API until total_steps groups, or the trainer's last step."""
        env = self.env
        env.open_clients(post_to_api=True)
        try:
            await env.setup()
            await self.register()
            # The queue before any group goes out: it may hold groups already (another
            # environment's, or this one's before a restart). Taken for empty until the first
            # read, every worker started a group beside them, over max_batches_offpolicy.
            self.state.curr_step = await self._read_status()
            env.init_wandb()
            await self._run_workers(True, asyncio.create_task(self._poll_status()))
            await env.wandb_log()
            logger.info("[env] done: %d groups posted, %s", self.state.groups_sent, env.counts)
        finally:
            await env.close_clients()

    async def process(self) -> None:
        """`process`: write total_steps kept groups to data_path_to_save_groups; no API."""
        if self.config.total_steps is None or not self.config.data_path_to_save_groups:
            raise ValueError(
                "process needs --env.total_steps N and --env.data_path_to_save_groups FILE.jsonl"
            )
        env = self.env
        env.open_clients()
        try:
            await env.setup()
            env.init_wandb()
            await self._run_workers(False)
            self.state.curr_step = self.state.groups_sent  # wandb's step axis: groups written
            await env.wandb_log()
            logger.info(
                "[env] done: %d groups written to %s, %s",
                self.state.groups_sent,
                self.config.data_path_to_save_groups,
                env.counts,
            )
        finally:
            await env.close_clients()

    async def evaluate_once(self) -> dict[str, float]:
        """`evaluate`: setup() then evaluate() once against the inference server."""
        env = self.env
        env.open_clients()
        try:
            await env.setup()
            env.init_wandb()
            metrics = await env.evaluate()
            # One line a script can read back (bench/learning_run.py does): the metrics as JSON.
            logger.info("[env] eval metrics %s", json.dumps(metrics, sort_keys=True))
            await env.wandb_log()
            return metrics
        finally:
            await env.close_clients()
