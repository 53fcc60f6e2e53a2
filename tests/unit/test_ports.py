"""Ports the launcher and the tests pick for servers: free, and never ones that a process asking
the kernel for "any free port" can be handed meanwhile (rank 1's vLLM once found its port taken)."""

from __future__ import annotations

import socket

import pytest

from example_trainer.engine import ports


def test_picked_ports_are_free_and_outside_the_range_the_kernel_hands_out():
    low, high = ports.ephemeral_ports()
    for _ in range(20):
        first = ports.free_port(3)
        for port in range(first, first + 3):
            assert not low <= port <= high
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))  # raises if taken


def test_a_block_with_one_port_taken_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = ports.free_port()
        starts = iter([busy - 1, free])  # the first block holds the busy port as its second

        class Picks:
            def randrange(self, first, last):
                return next(starts)

        monkeypatch.setattr(ports.random, "Random", Picks)
        assert ports.free_port(2) == free


def test_ports_are_picked_above_the_range_when_it_leaves_no_room_below(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_PORTS_FILE", ranges)
    assert ports.free_port(2) > 60999


def test_ports_are_picked_anywhere_above_well_known_ones_when_the_range_leaves_no_room(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_PORTS_FILE", ranges)
    assert ports.FIRST_PICKED_PORT <= ports.free_port(2) <= 65534


def test_an_explicit_vllm_port_whose_second_rank_is_held_is_refused_before_anything_starts(tmp_path):
    """Data parallel: rank 1's server binds --vllm-server-port + 1. Held, it once failed that rank only after
    the model had loaded; now the launcher refuses first and starts nothing."""
    from example_trainer.config import TrainerConfig
    from example_trainer.launcher import LoopConfig, run_loop
    first = ports.free_port(2)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", first + 1))
        taken.listen()
        cfg = LoopConfig(run_dir=str(tmp_path), gpus=2, vllm_server_port=first, echo="", trainer=TrainerConfig(parallel="data"))
        with pytest.raises(ValueError, match=rf"in use already: {first + 1} \(--vllm-server-port\)"):
            run_loop(cfg)
    assert list(tmp_path.iterdir()) == []  # no API, environment or trainer log: nothing was started


def test_an_api_port_inside_the_vllm_ports_is_refused(tmp_path):
    from example_trainer.config import TrainerConfig
    from example_trainer.launcher import LoopConfig, run_loop
    first = ports.free_port(3)
    cfg = LoopConfig(run_dir=str(tmp_path), gpus=2, vllm_server_port=first, api_port=first + 1, echo="",
                     trainer=TrainerConfig(parallel="data"))
    with pytest.raises(ValueError, match=rf"port {first + 1} is --api-port's and --vllm-server-port's"):
        run_loop(cfg)


def test_picked_ports_keep_clear_of_ports_a_user_chose(monkeypatch):
    """A user's --vllm-server-port is not bound until vLLM starts: the API's picked port once could be it."""
    chosen = ports.free_port()
    free = ports.free_port(2, avoid={chosen, chosen + 1})
    starts = iter([chosen - 1, free])  # the first block would end on the chosen port

    class Picks:
        def randrange(self, first, last):
            return next(starts)

    monkeypatch.setattr(ports.random, "Random", Picks)
    assert ports.free_port(2, avoid={chosen}) == free


def test_a_port_outside_the_tcp_range_is_refused_by_its_flag():
    with pytest.raises(ValueError, match=r"--vllm-server-port: port 65536 is not a TCP port"):
        ports.check_ports_free({"--vllm-server-port": [65535, 65536]})


def test_the_launcher_says_which_port_is_taken_instead_of_a_traceback(tmp_path):
    from example_trainer import launcher
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"^\[launcher\] in use already: {busy} \(--vllm-server-port\)"):
            launcher.main(["--run-dir", str(tmp_path), "--vllm-server-port", str(busy)])


def test_a_port_whose_last_connection_waits_out_time_wait_is_free_for_the_next_run():
    """The demo run twice in a row stopped at once with "in use already: 8000 (--api-port), 9001
    (--vllm-server-port)": the first run's servers had closed connections that stay in TIME_WAIT on
    their ports for a minute, which a plain bind refuses and the servers' own binds (SO_REUSEADDR)
    do not."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its end of the connection goes to TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("0.0.0.0", port))  # what the check did before
    with socket.socket() as next_server:  # what vLLM's and uvicorn's servers do
        next_server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        next_server.bind(("0.0.0.0", port))
    assert ports.port_free(port)
    ports.check_ports_free({"--api-port": [port]})


def test_a_port_a_server_listens_on_is_still_taken_with_reuse_addr():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert not ports.port_free(server.getsockname()[1])


def test_a_port_a_loading_vllm_has_bound_but_not_listened_on_is_taken():
    """vLLM binds its port (SO_REUSEADDR) before it loads the model and listens only after: a second
    run on that port must be refused then, not minutes later when one of the two cannot listen."""
    with socket.socket() as loading:
        loading.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        loading.bind(("0.0.0.0", 0))
        port = loading.getsockname()[1]
        assert not ports.port_free(port)
        with pytest.raises(ValueError, match=rf"in use already: {port} \(--vllm-server-port\)"):
            ports.check_ports_free({"--vllm-server-port": [port]})
