"""The launcher stops the run when a process the trainer depends on is gone."""

from __future__ import annotations

import logging
import time

from example_trainer.launcher import LoopConfig, run_loop


def test_an_environment_that_exits_stops_the_run_instead_of_leaving_the_trainer_waiting(tmp_path, caplog):
    """Before, the trainer waited for batches that never came until --timeout (an hour by default)."""
    cfg = LoopConfig(run_dir=str(tmp_path), environment="no_such", steps=1, timeout=600, echo="")
    begin = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="onecopy.launcher"):
        result = run_loop(cfg)
    assert result.returncode is None
    assert time.monotonic() - begin < 120
    assert "the environment" in caplog.text and "exited with 1 before the trainer" in caplog.text
    assert "No module named environments.no_such_server" in caplog.text


def test_an_environment_that_finished_does_not_stop_the_trainers_last_steps(tmp_path):
    """An environment exits 0 once the trainer took its last batch, while that step still trains;
    the first version of the check above stopped the trainer there (seen in bench/memory.py)."""
    import subprocess
    import sys

    from example_trainer.launcher import _wait_for_trainer

    done_env = subprocess.Popen([sys.executable, "-c", "pass"])
    done_env.wait()
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    log = tmp_path / "env.log"
    log.write_text("[env] trainer reached num_steps=2; stopping\n")
    assert _wait_for_trainer(trainer, {"environment": (done_env, log)}, timeout=60) == 0


def test_a_helper_that_fails_while_the_trainer_finishes_its_last_step_keeps_the_trainers_exit_code(tmp_path):
    """The API or environment may fail after the trainer took its last batch; the trainer's own
    result still counts if it ends within the grace period (before, it was stopped at once)."""
    import subprocess
    import sys

    from example_trainer.launcher import _wait_for_trainer

    failed_env = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    failed_env.wait()
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    log = tmp_path / "env.log"
    log.write_text("Traceback: the environment failed\n")
    assert _wait_for_trainer(trainer, {"environment": (failed_env, log)}, timeout=60) == 0
