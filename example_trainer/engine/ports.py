"""TCP ports for the servers a run starts (trajectory API, vLLM): free, and out of the way of
ports the kernel hands to other processes meanwhile."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(count: int = 1, avoid: frozenset[int] | set[int] = frozenset()) -> int:
    """The first of ``count`` consecutive TCP ports that nothing holds now and none of which is in
    ``avoid`` (ports a user chose that are not bound yet), below the kernel's
    ephemeral range. A port from that range is what any process gets when it asks for "any free
    port" (bind to 0: vLLM's internal sockets, torchrun, every outgoing connection), so one picked
    there could be taken before our server binds it: a data-parallel CI run's second vLLM found
    ``--vllm-server-port`` + 1 in use and its rank failed."""
    low, high = ephemeral_ports()
    # Where the range leaves no room below it (an unusual ip_local_port_range), above it; where it
    # leaves none either side, anywhere from FIRST_PICKED_PORT (a rare collision is then possible).
    if low - count > FIRST_PICKED_PORT + ROOM:
        first, last = FIRST_PICKED_PORT, low - count
    elif 65536 - count > high + 1 + ROOM:
        first, last = high + 1, 65536 - count
    else:
        first, last = FIRST_PICKED_PORT, 65536 - count
    picks = random.Random()
    for _ in range(1000):
        start = picks.randrange(first, last + 1)
        if all(port not in avoid and port_free(port) for port in range(start, start + count)):
            return start
    raise RuntimeError(f"found no {count} consecutive free TCP ports in {first}-{last + count - 1}")


FIRST_PICKED_PORT = 10000  # below: well-known services
ROOM = 1000  # the fewest ports worth picking from outside the ephemeral range
EPHEMERAL_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for "any free port" (Linux's default where it cannot be read)."""
    try:
        low, high = map(int, EPHEMERAL_PORTS_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


class PortsTaken(ValueError):
    """Ports a user chose that cannot serve: held already, named twice, or not TCP ports."""


def check_ports_free(ports: dict[str, list[int]]) -> None:
    """Raise, naming the flag, when a port a user chose is held already or is named twice: a vLLM
    server or the API would otherwise fail minutes later, after the model had loaded. ``ports``
    maps each flag to the ports it stands for (``--vllm-server-port`` to one per data-parallel server)."""
    owners: dict[int, str] = {}
    for flag, numbers in ports.items():
        for port in numbers:
            if not 1 <= port <= 65535:
                raise PortsTaken(f"{flag}: port {port} is not a TCP port (1-65535)")
            if port in owners:
                raise PortsTaken(f"port {port} is {owners[port]}'s and {flag}'s: choose ports that do not overlap")
            owners[port] = flag
    held = [f"{port} ({flag})" for port, flag in owners.items() if not port_free(port)]
    if held:
        raise PortsTaken(f"in use already: {', '.join(held)}; free them, choose others, or pass 0 for a free one")


def port_free(port: int) -> bool:
    """Whether a TCP server could bind ``port`` on every address now.

    A port whose only sockets are connections of an earlier run waiting out TCP's TIME_WAIT (for a
    minute after the server closed them) counts as free: vLLM's and uvicorn's servers bind with
    ``SO_REUSEADDR``, which ignores them. A plain bind refused it, which stopped a demo started right
    after another one. Any other socket on the port (a vLLM still loading has bound it but does not
    listen yet) keeps it taken."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            pass
    states = socket_states(port)
    return bool(states) and states <= {TIME_WAIT}


TIME_WAIT = "06"  # the state column of /proc/net/tcp
TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def socket_states(port: int) -> set[str]:
    """The states of this machine's TCP sockets whose local port is ``port`` (empty where the
    kernel's tables cannot be read)."""
    states = set()
    for table in TCP_TABLES:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                states.add(fields[3])
    return states
