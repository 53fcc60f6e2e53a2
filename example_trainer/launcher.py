"""Run the whole loop (trajectory API, environment, trainer) and stop each process by its PID.

Each is a process in its own session; the trainer starts vLLM itself.

    python -m example_trainer.launcher --run-dir runs/demo --weight-bridge-mode shared_vllm --max-steps 4
    python -m example_trainer.launcher --gpus 4 --parallel data ...   # torchrun, a vLLM + environment per GPU

Its own flags are the launcher's (the run folder, the environment it starts, the ports, the time
limit); every other flag is the trainer's (example_trainer/config.py), parsed by the trainer's
config and passed on as given, with the trainer's defaults.

scripts/run_demo.sh, the end-to-end tests, bench/modes.py and bench/learning_run.py all run the
loop through ``run_loop``; each adds only its own environment and trainer flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from environments.cli import environment_module
from environments.config_flags import add_dataclass_flags, as_flags, errors_to_parser, field, flag_name, flag_text
from example_trainer.config import TrainerConfig
from example_trainer.engine.ports import PortsTaken, check_ports_free, free_port
from example_trainer.engine.vllm_process import spawn_in_own_group, stop_group
from example_trainer.modes import MODES
from example_trainer.profiles import PROFILES

logger = logging.getLogger("onecopy.launcher")

ROOT = Path(__file__).resolve().parents[1]
# A helper (API, environment) that failed may have done so after the trainer took its last batch.
FAILED_HELPER_GRACE_SECONDS = 30.0
# The trainer log's lines the launcher prints while it runs (the whole log is in RUN_DIR/trainer.log):
# its steps, every warning and error, and each "waited N s for a batch" (what it waits for, and the
# groups the environments dropped meanwhile, why, and the flag that keeps them). Not the other
# ranks' "has waited N s for rank 0's batch": rank 0's own line says it once.
DEMO_LINES = (r"\[trainer\] (step|reward|done|waited)|\[vLLM\] healthy|\[Setup\]|WARNING (?!.*\[parallel\] rank \d+ has waited)"
              r"|ERROR|Error|metric|time/|sync/")


# The trainer's flags the launcher sets itself, from its own: where the trainer finds the API and
# vLLM, where it writes, and (mode colocate) the environment it runs.
SET_BY_LAUNCHER = {"api_url": "--api-port", "vllm_server_port": "--vllm-server-port", "output_dir": "--run-dir",
                   "environment": "--environment", "env_args": "--env-args"}


@dataclass
class LoopConfig:
    """One run of the loop: the launcher's own settings, and the trainer's config (``trainer``),
    whose flags the trainer gets as they are."""

    run_dir: str = field("runs/demo", "folder for the logs, the API's queue and the trainer's run (RUN_DIR/run)")
    environment: str = field("arithmetic", "environment module: environments/<name>_server.py, or a dotted "
                             "module path (my_pkg.my_env_server) run as python -m")
    num_generations: int = field(4, "completions per prompt: passed on as each environment's --env.group_size (the "
                                 "environment samples the groups)", old_names=("--group-size",))
    api_port: int = field(0, "trajectory API port (0 = a free one)")
    vllm_server_port: int = field(0, "the trainer's --vllm-server-port (0 = a free one; data parallel: rank r's is "
                                  "this + r)", old_names=("--vllm-port",))
    timeout: float = field(3600.0, "seconds the trainer may run before it is stopped")
    env_args: str = field("--env.max_tokens 64 --env.difficulty 1 --env.operations +",
                          "more environment flags, one shell-quoted string")
    echo: str = field(DEMO_LINES, "print the trainer log's lines that match this regex while it runs ('' = none)")
    gpus: int = field(1, "trainer processes (torchrun --nproc-per-node) for the trainer's --parallel data or tensor")
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)  # not a flag: the trainer's flags fill it

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {self.gpus}")
        if self.gpus > 1 and self.trainer.parallel == "none":
            raise ValueError(f"--gpus {self.gpus} needs --parallel data or tensor")
        for name, flag in SET_BY_LAUNCHER.items():
            if getattr(self.trainer, name) != getattr(TrainerConfig, name):
                raise ValueError(f"the launcher sets the trainer's --{name.replace('_', '-')} itself: give {flag}")


# A line that starts an entry of the trainer's log ("2026-11-29 17:54:07,449 ERROR onecopy...").
LOG_ENTRY = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ([A-Z]+) ")


@dataclass
class LoopResult:
    returncode: int | None  # None: stopped (the timeout, or the API or environment exited first)
    metrics: list[dict]
    trainer_log: str
    run_dir: Path
    stopped: str = ""  # why the run was stopped when returncode is None ("the environment exited with 1 ...")

    @property
    def outcome(self) -> str:
        """How the run ended, for a message: "exit N", or "stopped: why"."""
        return f"exit {self.returncode}" if self.returncode is not None else f"stopped: {self.stopped}"

    def failure_report(self, tail: int = 4000) -> str:
        """For a message about a failed run: the trainer log's ERROR entries, each with the lines that
        follow it (a rank's failure names its cause there, torchrun's report of it comes last), then
        the log's last ``tail`` characters."""
        entries, keep = [], False
        for line in self.trainer_log.splitlines():
            entry = LOG_ENTRY.match(line)
            if entry:
                keep = entry.group(1) == "ERROR"
            if keep:
                entries.append(line)
        return "\n".join([*entries[:200], "--- the log's end:", self.trainer_log[-tail:]])


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``python args...`` in its own session, logging to ``log``; stop it with ``stop_group``.

    It runs in the caller's folder, so a relative path in any flag (``--model``, ``--run-dir``, a
    trainer or environment flag) names what it names where the user typed it; this checkout comes
    first on its path, so ``-m`` finds this project's modules from any folder."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with open(log, "wb") as out:
        return spawn_in_own_group([sys.executable, *args], out, {**os.environ, "PYTHONPATH": path, **(env or {})})


def run_loop(cfg: LoopConfig, trainer_args: list[str] = (), while_training: Callable[[Path], None] | None = None
             ) -> LoopResult:
    """API + environment + trainer until the trainer exits (or ``cfg.timeout``); stops all three.
    The trainer gets ``cfg.trainer`` as flags (those that differ from its defaults), then the
    launcher's (API URL, vLLM port, save path), then ``trainer_args``, which come last, so they win.
    ``while_training(run_dir)`` runs meanwhile."""
    out = Path(cfg.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The API's port, then one per vLLM server (rank r's is vllm_server_port + r): the ones the user chose are
    # checked (colocate binds none), the others picked as one block around them.
    trainer_cfg = cfg.trainer
    in_process = MODES[trainer_cfg.weight_bridge_mode].in_process
    # Data parallel: a vLLM per rank, unless the mode's ranks share one (server)
    servers = cfg.gpus if trainer_cfg.parallel == "data" and not MODES[trainer_cfg.weight_bridge_mode].one_vllm else 1
    chosen = {"--api-port": [cfg.api_port] if cfg.api_port else [],
              "--vllm-server-port": [cfg.vllm_server_port + rank for rank in range(servers)] if cfg.vllm_server_port else []}
    if not in_process:
        check_ports_free(chosen)
    block = free_port(1 + servers, avoid={port for ports in chosen.values() for port in ports})
    api_port, vllm_server_port = cfg.api_port or block, cfg.vllm_server_port or block + 1
    api_url = f"http://127.0.0.1:{api_port}"
    env_flags = ["--env.group_size", str(cfg.num_generations), *shlex.split(cfg.env_args)]
    helpers: dict[str, tuple[subprocess.Popen, Path]] = {}

    if in_process:  # the environment runs inside the trainer: no API, no environment process
        trainer_args = ["--environment", cfg.environment, "--env-args", shlex.join(env_flags), *trainer_args]
    else:
        # A fresh queue per run: a run must not meet an earlier run's trainer registration or groups.
        db = out / f"api-{time.time_ns()}.db"
        helpers["API"] = (start(["-m", "api.server", "--port", str(api_port), "--db-path", str(db)], out / "api.log"),
                          out / "api.log")
        # Data parallel: one environment per vLLM server (rank r's on vllm_server_port + r), one API.
        for rank in range(servers):
            name, log = ("environment", out / "env.log") if rank == 0 else (f"environment {rank}", out / f"env{rank}.log")
            helpers[name] = (start(["-m", environment_module(cfg.environment), "serve",
                                    "--env.max_token_length", str(trainer_cfg.seq_len), "--env.rollout_server_url",
                                    api_url, "--openai.base_url", f"http://127.0.0.1:{vllm_server_port + rank}",
                                    *([] if trainer_cfg.model_name == "default" else
                                      ["--env.tokenizer_name", trainer_cfg.model_name]),
                                    *env_flags], log), log)
    trainer, returncode, stopped = None, None, ""
    # One trainer process, or torchrun's N (it stops them all when one fails).
    runner = ["-m", "example_trainer.grpo"] if trainer_cfg.parallel == "none" else [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cfg.gpus), "-m", "example_trainer.grpo"]
    try:
        trainer = start([*runner, *trainer_flags(trainer_cfg), "--api-url", api_url, "--vllm-server-port", str(vllm_server_port),
                         "--output-dir", str(out / "run"), *trainer_args], out / "trainer.log")
        pids = [f"{name} pid {proc.pid}" for name, (proc, _) in helpers.items()] + [f"trainer pid {trainer.pid}"]
        logger.info("[launcher] %s; logs in %s", ", ".join(pids), out)
        with _Echo(out / "trainer.log", cfg.echo):
            # In a thread, so a trainer that exits (or a helper that fails) is seen while it runs.
            watch = _Meanwhile(while_training, out / "run") if while_training is not None else None
            returncode, stopped = _wait_for_trainer(trainer, helpers, cfg.timeout, watch)
            if watch is not None:
                watch.raise_failure()
    finally:
        if trainer is not None:
            stop_group(trainer)  # SIGTERM first: the trainer then stops the vLLM it started
        for proc, _ in reversed(helpers.values()):  # the environment, then the API
            stop_group(proc)
    metrics_file = out / "run" / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return LoopResult(returncode, metrics, (out / "trainer.log").read_text(errors="replace"), out, stopped)


def trainer_flags(trainer: TrainerConfig) -> list[str]:
    """The trainer's command line for ``trainer``: a flag for each setting that is not the trainer's
    default, and for each one its ``--profile`` names, whatever its value (a flag given beside the
    profile set it back to its default: the trainer would otherwise take the profile's)."""
    named = PROFILES.get(trainer.profile, {}) if trainer.profile else {}
    return as_flags(trainer) + [word for name in named if getattr(trainer, name) == getattr(TrainerConfig, name)
                                for word in (flag_name(name), flag_text(getattr(trainer, name)))]


class _Meanwhile:
    """``function(run_dir)`` in a daemon thread: one still waiting for a step that a dead trainer never
    logs does not hold the caller; what it raises is raised in the caller."""

    def __init__(self, function: Callable[[Path], None], run_dir: Path) -> None:
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(function, run_dir), daemon=True)
        self._thread.start()

    def _run(self, function: Callable[[Path], None], run_dir: Path) -> None:
        try:
            function(run_dir)
        except BaseException as err:  # a test's pytest.fail too: handed to the caller, which raises it
            self.failure = err

    def raise_failure(self) -> None:
        self._thread.join(timeout=5)  # one that was about to fail when the trainer ended
        if self.failure is not None:
            raise self.failure


def _wait_for_trainer(trainer: subprocess.Popen, helpers: dict[str, tuple[subprocess.Popen, Path]],
                      timeout: float, watch: _Meanwhile | None = None) -> tuple[int | None, str]:
    """The trainer's exit code and "", or None and why the run was stopped: it ran past ``timeout``,
    the caller's watch failed, or a helper process failed first (the trainer would wait for batches
    that never come). An environment that is done exits 0 while the trainer still trains its last
    steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return trainer.wait(timeout=1.0), ""
        except subprocess.TimeoutExpired:
            pass
        if watch is not None and watch.failure is not None:
            return None, f"the caller's watch failed: {watch.failure}"
        for name, (proc, log) in helpers.items():
            if proc.poll() not in (None, 0):
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
                logger.error("[launcher] the %s (pid %d) exited with %s before the trainer. Last lines of %s:\n%s",
                             name, proc.pid, proc.returncode, log, tail)
                try:  # the trainer may hold its last batch already (saving, say): let it finish
                    return trainer.wait(timeout=FAILED_HELPER_GRACE_SECONDS), ""
                except subprocess.TimeoutExpired:
                    logger.error("[launcher] the trainer did not finish within %.0f s of that: stopping the run",
                                 FAILED_HELPER_GRACE_SECONDS)
                    return None, f"the {name} exited with {proc.returncode} (see {log})"
    logger.error("[launcher] the trainer ran past %.0f s: stopping it", timeout)
    return None, f"the trainer ran past {timeout:.0f} s"


class _Echo:
    """Prints the lines of a growing log that match ``pattern``, from a thread, inside a ``with``."""

    def __init__(self, path: Path, pattern: str) -> None:
        self.path, self.pattern = path, re.compile(pattern) if pattern else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with open(self.path, errors="replace") as log:
            while True:
                line = log.readline()
                if line and self.pattern.search(line):
                    print(line, end="", flush=True)
                elif not line:
                    if self._stop.is_set():
                        return
                    time.sleep(0.3)

    def __enter__(self):
        if self.pattern is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.pattern is not None:
            self._thread.join()


def parse_loop_config(argv: list[str]) -> LoopConfig:
    """The launcher's flags and the trainer's (all but those it sets itself, ``SET_BY_LAUNCHER``)
    from one command line; a trainer flag is read by the trainer's own config, with its defaults,
    its ``--profile`` and its checks. A ``--`` before the trainer's flags is allowed (the older form)."""
    argv = [arg for arg in argv if arg != "--"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_dataclass_flags(parser, LoopConfig, exclude={"trainer"}, title="the launcher")
    add_dataclass_flags(parser, TrainerConfig, exclude=set(SET_BY_LAUNCHER), title="the trainer")
    given = vars(parser.parse_args(argv))
    ours = {f.name for f in dataclasses.fields(LoopConfig)}
    with errors_to_parser(parser):
        trainer = TrainerConfig(**TrainerConfig.fill_given({k: v for k, v in given.items() if k not in ours}))
        return LoopConfig(**{k: v for k, v in given.items() if k in ours}, trainer=trainer)
    raise AssertionError("unreachable: parser.error exits")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_loop_config(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start_time = time.monotonic()
    try:
        result = run_loop(cfg)
    except PortsTaken as err:  # said before anything started
        raise SystemExit(f"[launcher] {err}") from err
    print(f"[launcher] mode={cfg.trainer.weight_bridge_mode}: trainer {result.outcome} after "
          f"{time.monotonic() - start_time:.0f} s; trainer log {result.run_dir / 'trainer.log'}", flush=True)
    raise SystemExit(0 if result.returncode == 0 else 1)


if __name__ == "__main__":
    main()
