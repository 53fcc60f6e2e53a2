"""The route server mode adds to onecopy's vLLM server (``ONECOPY_WEIGHT_SERVER=1``).

  GET /weights/digest   every worker's checksum of each of its parameters and the weights version
                        they hold (every engine's workers, with --data-parallel-size), read between two steps: what vLLM computes with, read from its
                        memory (tests compare it with the trainer's checkpoints)
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from vllm_patching.compat import collective_rpc_per_engine

router = APIRouter()


@router.get("/weights/digest")
async def weights_digest(request: Request) -> dict:
    """One entry per worker, engine by engine: {weights_version, tp_rank, engine, tensors: {name: {sha256,
    shape, dtype}}}."""
    per_engine = await collective_rpc_per_engine(request.app.state.engine_client, "onecopy_weights_digest")
    return {"workers": [worker for workers in per_engine for worker in workers]}
