"""Mode server's weights gates, one per vLLM engine: with vLLM's ``--data-parallel-size D`` the
server runs D engines, each a process with its own scheduler, workers, gate and bridge file
(vllm_patching.weight_receiver), and the trainer writes to all of them in one write.

A write closes every engine's gate, always in engine order, before the first byte is sent, and
opens them only after every worker of every engine has acked: no engine steps on half-updated
weights, and all move from one version to the next together (each engine's scheduler salts its
prefix cache and tags its tokens from its own gate, so the versions must agree). The engines of a
dense model are independent (vLLM runs each as an engine of size 1), so a closed gate on one holds
no step of another; an MoE model's engines step in lockstep and are refused (the worker says why).
"""

from __future__ import annotations

from vllm_patching.gate import TrainerGate


class EngineGates:
    """The trainer's gate of each engine's leading worker, in engine order."""

    def __init__(self, gates: list[TrainerGate]) -> None:
        if not gates:
            raise ValueError("vLLM named no engine's weights gate")
        self.gates = gates

    def alive(self) -> bool:
        """Every engine's leading worker still runs (vLLM stops the whole server when one dies)."""
        return all(gate.exporter_alive() for gate in self.gates)

    @property
    def worker_pids(self) -> list[int]:
        """Each engine's leading worker's pid."""
        return [gate.exporter_pid for gate in self.gates]

    @property
    def pids(self) -> str:
        """The leading workers' pids, for messages: '123' or '123, 456'."""
        return ", ".join(map(str, self.worker_pids))

    def exited(self) -> str:
        """Which leading workers have exited, for messages: 'vLLM worker pid 123 exited'."""
        gone = [str(gate.exporter_pid) for gate in self.gates if not gate.exporter_alive()]
        return f"vLLM worker pid {', '.join(gone) or '(none seen yet)'} exited"

    def begin_write(self) -> None:
        """Close every gate, in engine order; if one cannot be closed, reopen those closed before it
        (their weights untouched) and raise its error (TrainerGate.begin_write's)."""
        closed = []
        try:
            for gate in self.gates:
                gate.begin_write()
                closed.append(gate)
        except BaseException:
            for gate in closed:
                gate.end_unwritten()  # their version moves on (TrainerGate says why): the others' lags
            raise
        # Every record now reads half-written (odd). One that lags (a write that closed only some
        # gates and gave up) is brought to the furthest, so that all engines salt and tag with one
        # version from this write on. Before the header is taken: the workers ack the header's.
        furthest = max(gate.record.write_seq for gate in self.gates)
        for gate in self.gates:
            gate.record.write_seq = furthest

    def header(self) -> list[int]:
        """The write's header: each engine's (write_seq, steps entered), in engine order
        (vllm_patching.weight_transfer)."""
        return [value for gate in self.gates for value in (gate.record.write_seq, gate.record.steps)]

    def end_write(self) -> None:
        """Every worker acked: every engine's weights whole again, every gate open."""
        for gate in self.gates:
            gate.end_write()

    @property
    def weights_version(self) -> int:
        """The version the engines hold; the lowest while they differ (a write that closed some
        gates only and gave up: the next write evens them)."""
        return min(gate.record.weights_version for gate in self.gates)

    def close(self) -> None:
        for gate in self.gates:
            gate.close()
