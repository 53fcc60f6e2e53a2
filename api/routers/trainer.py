"""Routes the trainer calls: register its batch shape, pull batches, read and reset state."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from api.deps import SettingsDep, StoreDep
from api.models import Batch, Info, RegisterResponse, Registration, Status, WandbInfo

logger = logging.getLogger("onecopy.api.trainer")
router = APIRouter(tags=["trainer"])

EMPTY_BATCH = b'{"batch":null}'


@router.post("/register", response_model=RegisterResponse)
def register(registration: Registration, store: StoreDep) -> RegisterResponse:
    """Register (or re-register) the trainer. The queue is kept; the step restarts at starting_step."""
    trainer = store.register_trainer(registration)
    logger.info("[API] trainer registered batch_size=%d max_token_len=%d starting_step=%d "
                "num_steps=%d", registration.batch_size, registration.max_token_len,
                registration.starting_step, registration.num_steps)
    return RegisterResponse(uuid=trainer.uuid)


@router.get("/info", response_model=Info)
def info(store: StoreDep) -> Info:
    """batch_size and max_token_len of the registered trainer; -1 each before one registers."""
    trainer = store.trainer()
    if trainer is None:
        return Info()
    return Info(batch_size=trainer.registration.batch_size,
                max_token_len=trainer.registration.max_token_len)


@router.get("/wandb_info", response_model=WandbInfo)
def wandb_info(store: StoreDep) -> WandbInfo:
    trainer = store.trainer()
    if trainer is None:
        return WandbInfo()
    return WandbInfo(group=trainer.registration.wandb_group,
                     project=trainer.registration.wandb_project)


@router.get("/batch", response_model=Batch)
def batch(store: StoreDep, settings: SettingsDep, refill: bool = False) -> Response:
    """Groups holding exactly batch_size sequences, oldest first; `{"batch": null}` if too few wait.

    Each served batch counts as a training step, except with `?refill=true`: a trainer that dropped
    groups of its last batch (stale, or all scores equal) fills the same step, and environments that
    stop at the trainer's last step must not stop early. Atropos trainers never send it.

    A served batch has left the queue: fetching again returns the next one. The stored JSON of
    each group is spliced into the response as it is, without parsing it again.
    """
    served = store.take_batch(settings.batch_window, count_step=not refill)
    if served is None:
        return Response(EMPTY_BATCH, media_type="application/json")
    logger.info("[API] served batch step=%d groups=%d sequences=%d",
                served.step, len(served.payloads), served.sequences)
    body = '{"batch":[' + ",".join(served.payloads) + "]}"
    return Response(body, media_type="application/json")


@router.get("/status", response_model=Status)
def status(store: StoreDep) -> Status:
    """current_step: starting_step plus batches served since; queue_size: queued groups."""
    step, queue_size = store.status()
    return Status(current_step=step, queue_size=queue_size)


@router.get("/reset_data", response_class=PlainTextResponse)
def reset_data(store: StoreDep) -> str:
    """Forget the queue, the trainer, the environments, seen group_uuids and the step."""
    store.reset()
    logger.info("[API] reset: queue, registrations and step cleared")
    return "Reset successful"
