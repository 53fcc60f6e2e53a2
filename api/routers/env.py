"""Routes environments call: register, disconnect, and ask how much work to keep in flight."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from api.deps import StoreDep
from api.models import EnvDropped, EnvIdentifier, EnvStatus, RegisterEnv, RegisterEnvResponse, StatusMessage
from api.store import Overview

logger = logging.getLogger("onecopy.api.env")
router = APIRouter(tags=["environment"])

MIN_ENV_WEIGHT = 0.01
WAIT_FOR_TRAINER = "wait for trainer to start"


@router.post("/register-env", response_model=RegisterEnvResponse, response_model_exclude_none=True)
def register_env(registration: RegisterEnv, store: StoreDep) -> RegisterEnvResponse:
    """An id for a new environment, or `{"status": "wait for trainer to start"}`: retry then."""
    admission = store.register_env(registration)
    if admission is None:
        return RegisterEnvResponse(status=WAIT_FOR_TRAINER)
    env, trainer = admission.env, admission.trainer.registration
    logger.info("[API] env registered env_id=%d name=%s group_size=%s weight=%s",
                env.env_id, env.wandb_name, registration.group_size, registration.weight)
    return RegisterEnvResponse(
        status="success",
        env_id=env.env_id,
        wandb_name=env.wandb_name,
        checkpoint_dir=trainer.checkpoint_dir,
        starting_step=admission.step,
        checkpoint_interval=trainer.save_checkpoint_interval,
        num_steps=trainer.num_steps,
    )


@router.post("/disconnect-env", response_model=StatusMessage)
def disconnect_env(env: EnvIdentifier, store: StoreDep) -> StatusMessage:
    """Stop counting this environment's weight; its queued groups stay queued."""
    store.disconnect_env(env.env_id)
    logger.info("[API] env disconnected env_id=%d", env.env_id)
    return StatusMessage(status="success")


@router.post("/env-dropped", response_model=StatusMessage)
def env_dropped(report: EnvDropped, store: StoreDep) -> StatusMessage:
    """An environment's totals of groups it dropped, by reason (onecopy's addition: a trainer
    waiting for a batch says why none comes)."""
    store.report_dropped(report.env_id, report.counts)
    return StatusMessage(status="success")


@router.get("/status-env", response_model=EnvStatus, operation_id="status_env_get")
@router.post("/status-env", response_model=EnvStatus, operation_id="status_env_post")
def status_env(env: EnvIdentifier, store: StoreDep) -> EnvStatus:
    """Step, queue and this environment's share of inference. Body: `{"env_id": int}`
    (Atropos's environments send it with GET)."""
    return env_status(store.overview(env.env_id), env.env_id)


def env_status(overview: Overview, env_id: int) -> EnvStatus:
    """Atropos's /status-env numbers, without its minimum-allocation packing.

    env_weight: this env's max_token_length * weight over the sum for connected envs (at least
    MIN_ENV_WEIGHT). queue_size / self_queue_size: all / this env's queued sequences, counted in
    groups of this env's size (its registered group_size or the largest group it queued).
    """
    me = next(env for env in overview.envs if env.env_id == env_id)
    connected = [env.registration for env in overview.envs if env.connected]
    total = sum(reg.max_token_length * max(0.0, reg.weight) for reg in connected)
    own = me.registration.max_token_length * max(0.0, me.registration.weight)
    env_weight = max(MIN_ENV_WEIGHT, own / total) if total > 0 else 1.0
    allocated = sum(reg.min_batch_allocation or 0.0 for reg in connected)

    own_sizes = [size for owner, size in overview.queued if owner == env_id]
    group_size = max([me.registration.group_size or 1, *own_sizes])
    return EnvStatus(
        current_step=overview.step,
        queue_size=sum(size for _, size in overview.queued) // group_size,
        self_queue_size=sum(own_sizes) // group_size,
        max_group_size=max([1, *(size for _, size in overview.queued)]),
        unallocated_fraction=1.0 - min(allocated, 1.0),
        env_weight=env_weight,
    )
