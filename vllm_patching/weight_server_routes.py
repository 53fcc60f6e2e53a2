"""The route server mode adds to onecopy's vLLM server (``ONECOPY_WEIGHT_SERVER=1``).

  GET /weights/digest   every worker's checksum of each of its parameters and the weights version
                        they hold, read between two steps: what vLLM computes with, read from its
                        memory (tests compare it with the trainer's checkpoints)
"""

from __future__ import annotations

from fastapi import APIRouter, Request

router = APIRouter()


@router.get("/weights/digest")
async def weights_digest(request: Request) -> dict:
    """One entry per tensor-parallel worker: {weights_version, tp_rank, tensors: {name: {sha256, shape, dtype}}}."""
    engine = request.app.state.engine_client
    return {"workers": await engine.collective_rpc("onecopy_weights_digest")}
