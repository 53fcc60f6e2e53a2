"""Routes the trainer calls: register its batch shape, pull batches, read and reset state."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from api.deps import SettingsDep, StoreDep
from api.models import Batch, Info, RegisterResponse, Registration, Status, TrainerStatus, WandbInfo

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
def batch(store: StoreDep, settings: SettingsDep, count_step: bool = True) -> Response:
    """Groups holding exactly batch_size sequences, oldest first; `{"batch": null}` if too few wait.

    Each served batch counts as a training step, as in Atropos, except with `?count_step=false`: a
    trainer that drops groups (stale, or all scores equal) may fetch several batches for one step,
    and counts the step itself with `POST /step` once its batch is full, so that environments, which
    stop at the trainer's last step, stop neither early nor never.

    A served batch has left the queue: fetching again returns the next one. The stored JSON of
    each group is spliced into the response as it is, without parsing it again.
    """
    served = store.take_batch(settings.batch_window, count_step=count_step)
    if served is None:
        return Response(EMPTY_BATCH, media_type="application/json")
    logger.info("[API] served batch step=%d groups=%d sequences=%d",
                served.step, len(served.payloads), served.sequences)
    body = '{"batch":[' + ",".join(served.payloads) + "]}"
    return Response(body, media_type="application/json")


@router.post("/step", response_model=Status)
def count_step(store: StoreDep) -> Status:
    """Count one training step without serving a batch (see `GET /batch?count_step=false`)."""
    step, queue_size = store.count_step()
    logger.info("[API] step %d counted by the trainer", step)
    return Status(current_step=step, queue_size=queue_size)


@router.get("/status", response_model=TrainerStatus, response_model_exclude_none=True)
def status(store: StoreDep, settings: SettingsDep) -> TrainerStatus:
    """current_step: starting_step plus the steps counted since (a served batch, or POST /step);
    queue_size: queued groups; queued_sequences: the rows in them; batch_ready: whether GET /batch
    would serve a batch now."""
    queue = store.status(settings.batch_window)
    return TrainerStatus(current_step=queue.step, queue_size=queue.groups, queued_sequences=queue.sequences,
                         batch_ready=queue.batch_ready, dropped=store.dropped() or None)


@router.get("/reset_data", response_class=PlainTextResponse)
def reset_data(store: StoreDep) -> str:
    """Forget the queue, the trainer, the environments, seen group_uuids and the step."""
    store.reset()
    logger.info("[API] reset: queue, registrations and step cleared")
    return "Reset successful"
