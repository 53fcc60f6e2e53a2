"""Routes that carry scored groups in: one group, a list of groups, and the latest one back."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from api.deps import StoreDep
from api.models import ScoredData, ScoredDataAck

logger = logging.getLogger("onecopy.api.data")
router = APIRouter(tags=["data"])

EMPTY_EXAMPLE = {
    "tokens": [], "masks": [], "scores": [], "advantages": [], "ref_logprobs": [],
    "generation_params": [], "inference_logprobs": [], "messages": [], "images": [],
}


@router.post("/scored_data", response_model=ScoredDataAck, response_model_exclude_none=True)
def scored_data(group: ScoredData, store: StoreDep) -> ScoredDataAck:
    """Queue one group: `{"status": "received"}`, or `{"status": "duplicate"}` when its
    group_uuid was queued before (nothing is stored twice)."""
    result = store.add_groups([group], indexed=False)
    if result.duplicates:
        logger.info("[API] duplicate group group_uuid=%s ignored", group.group_uuid)
        return ScoredDataAck(status="duplicate")
    logger.info("[API] stored group env_id=%s size=%d queue=%d",
                group.env_id, len(group.tokens), result.queue_size)
    return ScoredDataAck(status="received")


@router.post("/scored_data_list", response_model=ScoredDataAck, response_model_exclude_none=True)
def scored_data_list(groups: list[ScoredData], store: StoreDep) -> ScoredDataAck:
    """Queue all groups or, if any breaks a rule, none (the error names its index)."""
    result = store.add_groups(groups, indexed=True)
    logger.info("[API] stored groups count=%d duplicates=%d queue=%d",
                result.stored, result.duplicates, result.queue_size)
    return ScoredDataAck(status="received", groups_processed=len(groups),
                         duplicates=result.duplicates)


@router.get("/latest_example")
def latest_example(store: StoreDep) -> Response:
    """The last group queued, as posted; empty lists before any."""
    latest = store.latest()
    if latest is None:
        return JSONResponse(EMPTY_EXAMPLE)
    return Response(latest, media_type="application/json")
