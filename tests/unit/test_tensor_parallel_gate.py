"""The weights gate of tensor-parallel trainer ranks (TensorParallelGate, gloo on CPU) when one
rank cannot close its gate: the vLLM TP workers are gates in this process, stepped by hand."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from example_trainer.engine.ports import free_port
from vllm_patching.gate import GateInfo, WorkerGate, health_problem


def closing_rank(rank: int, port: int, infos: list[dict], exporter_pid: int, out: str) -> None:
    """Trainer rank ``rank``: open its worker's gate and try to begin a write; save what it raised."""
    import torch.distributed as dist

    from example_trainer.bridges.tensor_parallel import TensorParallelGate
    from vllm_patching.gate import TrainerGate

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(infos))
    gate = TensorParallelGate(TrainerGate(GateInfo(**infos[rank]), torch.device("cpu"), exporter_pid, timeout=0.5))
    try:
        gate.begin_write()
        raised = None
    except Exception as err:  # noqa: BLE001 - saved for the test to check
        raised = f"{type(err).__name__}: {err}"
    finally:
        gate.close()  # what the loop's finish() does on the way out
        dist.destroy_process_group()
    torch.save(raised, f"{out}/rank{rank}.pt")


def test_a_rank_that_cannot_stop_its_worker_leaves_every_ranks_weights_whole_and_vllm_stepping(tmp_path):
    """Ranks 0 and 1 close their gates (marking the weights half-written); rank 2's worker never
    ends the step rank 0's entered, so rank 2 times out and every rank stops before writing. Nothing
    was written: vLLM must step on, not refuse weights that only look half-written."""
    gates = [WorkerGate(f"tpfail{r}{os.getpid()}", torch.device("cpu"), tmp_path, tp_rank=r) for r in range(3)]
    try:
        for gate in gates[:2]:  # workers 0 and 1 ran one step; worker 2 is stuck in it
            gate.begin_step()
            gate.end_step()
        mp.spawn(closing_rank, args=(free_port(), [g.info().model_dump() for g in gates], os.getpid(), str(tmp_path)),
                 nprocs=3)
        raised = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
        assert raised[2].startswith("GateTimeout: the trainer waited 0.5 s") and "has ended 0 of the 1 steps" in raised[2]
        for r in (0, 1):
            assert raised[r].startswith("GateTimeout: another tensor-parallel rank could not close"), raised[r]
        for r, gate in enumerate(gates):  # the shared record, as vLLM's worker and /health read it
            assert not gate.file.status()["half_written"], f"rank {r}'s weights are left marked half-written"
            assert health_problem(gate.file.record) is None
        assert gates[0].file.status()["weights_version"] == 1  # moved on, never back (gate.end_unwritten)
        assert gates[0]._try_enter(), "vLLM's rank-0 worker cannot step after a write that wrote nothing"
        gates[0].end_step()
        assert not gates[0].file.status()["refusing"]
    finally:
        for gate in gates:
            gate.close()
