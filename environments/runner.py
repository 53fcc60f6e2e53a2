"""How an environment runs: the `serve`, `process` and `evaluate` loops of BaseEnv.

    serve:    setup() -> register_env() -> max_num_workers workers, each looping
              get_next_item() -> collect_trajectories() -> handle_send_to_api()
              beside a status poller (trainer step, API queue, periodic evaluate() and wandb_log())
              until total_steps groups are posted or the trainer reaches its num_steps
    process:  setup() -> the same workers, writing JSONL instead of posting (no API)
    evaluate: setup() -> evaluate() once

EnvRunner is a mixin of BaseEnv (environments/base.py), kept apart so each file stays short: it
calls the hooks and state that BaseEnv defines.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Optional

from environments.clients import InferenceClient, TrajectoryApiClient

logger = logging.getLogger("onecopy.env")
Item = Any


class EnvRunner:
    """The loops of BaseEnv; see the module docstring for the order of calls."""

    def _quota_reached(self) -> bool:
        return self.config.total_steps is not None and self.groups_sent >= self.config.total_steps

    def _trainer_done(self) -> bool:
        return self.num_steps is not None and self.curr_step >= self.num_steps

    async def _next(self) -> Optional[Item]:
        if self.backlog:
            return self.backlog.pop(0)
        return await self.get_next_item()

    async def _wait_for_room(self) -> None:
        """Back-pressure: hold off while the API queue has max_batches_offpolicy batches waiting."""
        if not self.batch_size or not self.config.max_batches_offpolicy:
            return
        limit = self.config.max_batches_offpolicy * self.batch_size
        logged = False
        while self.queue_size * self.config.group_size >= limit and not self._trainer_done():
            if not logged:
                logger.info("[env] API queue holds %d groups; waiting for the trainer", self.queue_size)
                logged = True
            await asyncio.sleep(self.status_poll_s)

    async def _worker(self, do_send_to_api: bool) -> None:
        while not (self._quota_reached() or self._trainer_done()):
            if do_send_to_api:
                await self._wait_for_room()
            item = await self._next()
            if item is None:
                logger.info("[env] no more items")
                return
            group, backlog = await self.collect_trajectories(item)
            self.backlog.extend(backlog)
            if group is not None:
                await self.handle_send_to_api(group, item, do_send_to_api)

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

    async def register_env(self) -> None:
        """Register with the API (waiting for the trainer) and read the trainer's settings."""
        reg = await self.api.register_env(
            {
                "max_token_length": self.config.max_token_length,
                "desired_name": self.config.wandb_name or self.name,
                "weight": self.config.inference_weight,
                "group_size": self.config.group_size,
            },
            poll_s=self.status_poll_s,
        )
        self.env_id = reg["env_id"]
        self.curr_step = reg.get("starting_step") or 0
        num_steps = reg.get("num_steps")
        self.num_steps = num_steps if num_steps and num_steps > 0 else None
        info = await self.api.info()
        if self.batch_size is None and info.get("batch_size", -1) > 0:
            self.batch_size = info["batch_size"]
        trainer_max = info.get("max_token_len", -1)
        if trainer_max > 0 and trainer_max < self.max_token_length:
            logger.info("[env] trainer accepts %d tokens: using that as max_token_length", trainer_max)
            self.max_token_length = trainer_max
        if self.batch_size is not None and self.config.group_size > self.batch_size:
            raise ValueError(
                f"--env.group_size {self.config.group_size} is larger than the trainer's "
                f"batch_size {self.batch_size}: a group must fit in one batch"
            )
        logger.info(
            "[env] registered env_id=%s name=%s step=%d num_steps=%s batch_size=%s",
            self.env_id,
            reg.get("wandb_name"),
            self.curr_step,
            self.num_steps,
            self.batch_size,
        )
        self.wandb_name = reg.get("wandb_name") or self.wandb_name

    async def _poll_status(self) -> None:
        """Serve only: follow the trainer's step and queue; evaluate and log as steps go by."""
        eval_task: Optional[asyncio.Task] = None
        last_eval = self.curr_step
        every = self.config.steps_per_eval
        try:
            while not self._trainer_done():
                await asyncio.sleep(self.status_poll_s)
                status = await self.api.status()
                step, self.queue_size = status["current_step"], status["queue_size"]
                if eval_task is not None and eval_task.done():
                    eval_task.result()  # surfaces an exception raised during evaluation
                    eval_task = None
                if step == self.curr_step:
                    continue
                self.curr_step = step
                if every and step // every > last_eval // every and eval_task is None:
                    last_eval = step
                    eval_task = asyncio.create_task(self.evaluate())
                await self.wandb_log()
            logger.info("[env] trainer reached num_steps=%s; stopping", self.num_steps)
        finally:
            if eval_task is not None:
                eval_task.cancel()

    def _open(self) -> None:
        path = self.config.data_path_to_save_groups
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            try:
                self._jsonl = open(path, "x", encoding="utf-8")  # never overwrite earlier groups
            except FileExistsError:
                raise FileExistsError(
                    f"--env.data_path_to_save_groups {path} exists; pass a new path"
                ) from None
        self.inference = InferenceClient(
            self.server_config.base_url,
            self.server_config.timeout,
            self.server_config.num_max_requests_at_once,
            self.backoff,
            model=self.server_config.model_name,
        )

    async def _close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for client in (self.inference, self.api):
            if client is not None:
                await client.aclose()
        if self._wandb is not None:
            self._wandb.finish()

    async def env_manager(self) -> None:
        """`serve`: post groups to the API until total_steps groups, or the trainer's last step."""
        self.api = TrajectoryApiClient(
            self.config.rollout_server_url, self.config.resolved_api_key(), self.backoff
        )
        self._open()
        try:
            await self.setup()
            await self.register_env()
            self._init_wandb()
            await self._run_workers(True, asyncio.create_task(self._poll_status()))
            await self.wandb_log()
            logger.info("[env] done: %d groups posted, %s", self.groups_sent, self.counts)
        finally:
            await self._close()

    async def process_manager(self) -> None:
        """`process`: write total_steps kept groups to data_path_to_save_groups; no API."""
        if self.config.total_steps is None or not self.config.data_path_to_save_groups:
            raise ValueError(
                "process needs --env.total_steps N and --env.data_path_to_save_groups FILE.jsonl"
            )
        self._open()
        try:
            await self.setup()
            self._init_wandb()
            await self._run_workers(False)
            self.curr_step = self.groups_sent
            await self.wandb_log()
            logger.info(
                "[env] done: %d groups written to %s, %s",
                self.groups_sent,
                self.config.data_path_to_save_groups,
                self.counts,
            )
        finally:
            await self._close()

    async def run_evaluate(self) -> dict[str, float]:
        """`evaluate`: setup() then evaluate() once against the inference server."""
        self._open()
        try:
            await self.setup()
            self._init_wandb()
            metrics = await self.evaluate()
            await self.wandb_log()
            return metrics
        finally:
            await self._close()
