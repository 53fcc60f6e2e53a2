"""The launcher stops the run when a process the trainer depends on is gone."""

from __future__ import annotations

import logging
import time

import pytest

from example_trainer import launcher
from environments.config_flags import config_fields, flag_name, parse_config
from example_trainer.config import TrainerConfig
from example_trainer.launcher import SET_BY_LAUNCHER, LoopConfig, parse_loop_config, run_loop


def test_an_environment_that_exits_stops_the_run_instead_of_leaving_the_trainer_waiting(tmp_path, caplog, monkeypatch):
    """Before, the trainer waited for batches that never came until --timeout (an hour by default)."""
    monkeypatch.setattr(launcher, "FAILED_HELPER_GRACE_SECONDS", 2.0)  # the trainer's grace: 30 s of waiting otherwise
    cfg = LoopConfig(run_dir=str(tmp_path), environment="no_such", timeout=600, echo="",
                     trainer=TrainerConfig(max_steps=1))
    begin = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="onecopy.launcher"):
        result = run_loop(cfg)
    assert result.returncode is None and result.stopped.startswith("the environment exited with 1")
    assert time.monotonic() - begin < 120
    assert "the environment" in caplog.text and "exited with 1 before the trainer" in caplog.text
    assert "the trainer did not finish within 2 s of that: stopping the run" in caplog.text
    assert "No module named environments.no_such_server" in caplog.text


@pytest.mark.parametrize("helper_exit", [0, 3])
def test_the_trainers_last_step_is_not_cut_by_a_helper_that_exits_meanwhile(tmp_path, helper_exit):
    """An environment exits 0 once the trainer took its last batch, while that step still trains
    (the first version of the check above stopped the trainer there, seen in bench/memory.py); a
    helper that fails then (3) leaves the trainer a grace period, and its own exit code counts."""
    import subprocess
    import sys

    from example_trainer.launcher import _wait_for_trainer

    helper = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({helper_exit})"])
    helper.wait()
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    log = tmp_path / "env.log"
    log.write_text("[env] trainer reached num_steps=2; stopping\n")
    assert _wait_for_trainer(trainer, {"environment": (helper, log)}, timeout=60) == (0, "")


def test_a_trainer_that_exits_ends_the_run_while_the_callers_watch_still_waits(tmp_path):
    """``while_training`` used to run before the launcher watched the trainer: a trainer that died at
    start (seen: an import error) left a test's kill-after-step-1 watch polling for 20 minutes."""
    cfg = LoopConfig(run_dir=str(tmp_path), timeout=600, echo="", trainer=TrainerConfig(max_steps=1))
    begin = time.monotonic()
    result = run_loop(cfg, ["--learning-rate", "-1"], while_training=lambda run_dir: time.sleep(300))
    assert result.returncode == 2 and "--learning-rate must be > 0" in result.trainer_log
    assert time.monotonic() - begin < 120


def test_a_watch_that_fails_stops_the_wait_for_the_trainer():
    import subprocess
    import sys

    from example_trainer.launcher import _Meanwhile, _wait_for_trainer

    def fail(run_dir):
        raise RuntimeError("the watch gave up")

    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        begin, watch = time.monotonic(), _Meanwhile(fail, None)
        assert _wait_for_trainer(trainer, {}, timeout=60, watch=watch) == (None, "the caller's watch failed: the watch gave up")
        assert time.monotonic() - begin < 10
        with pytest.raises(RuntimeError, match="the watch gave up"):
            watch.raise_failure()
    finally:
        trainer.kill()
        trainer.wait()


def test_a_stopped_run_says_why_where_an_exit_code_would_be():
    from pathlib import Path

    from example_trainer.launcher import LoopResult
    assert LoopResult(3, [], "", Path(".")).outcome == "exit 3"
    assert LoopResult(None, [], "", Path("."), "the trainer ran past 5 s").outcome == "stopped: the trainer ran past 5 s"


def test_every_trainer_flag_is_a_launcher_flag_with_the_trainers_default():
    """The launcher once re-declared ten trainer settings, four with other defaults (--seq-len 320,
    --learning-rate 2e-5, --steps 4 against the trainer's 512, 1e-5, 10); now it reads the trainer's flags with
    the trainer's config, so given nothing it runs the trainer's defaults."""
    assert parse_loop_config([]).trainer == TrainerConfig()
    assert LoopConfig().trainer == TrainerConfig()
    for name in config_fields(TrainerConfig):
        if name in SET_BY_LAUNCHER:
            continue
        value = "true" if name in ("resume", "benchmark") else None
        if value is not None:
            assert getattr(parse_loop_config([flag_name(name), value]).trainer, name) is True, name


def test_a_trainer_flag_given_to_the_launcher_reaches_the_trainers_command(tmp_path, monkeypatch):
    """What the launcher starts the trainer with parses, with the trainer's own config, into the
    config the launcher read: the flags pass through unchanged (a profile, an alias, an old ``--``)."""
    commands = []

    class Exited:
        pid = 0

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return None

    def start(args, log, env=None):
        commands.append(list(args))
        log.write_text("")
        return Exited()

    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "stop_group", lambda proc: None)
    cfg = parse_loop_config(["--run-dir", str(tmp_path), "--echo", "", "--profile", "lean", "--learning-rate", "3e-6",
                             "--max-steps", "2", "--", "--staged-step", "--probe-prompt", ""])
    assert (cfg.trainer.learning_rate, cfg.trainer.staged_step, cfg.trainer.bf16_inplace) == (3e-6, True, True)
    assert run_loop(cfg).returncode == 0
    trainer = next(args for args in commands if "example_trainer.grpo" in args)
    argv = trainer[trainer.index("example_trainer.grpo") + 1:]
    received = parse_config(TrainerConfig, argv)
    assert received == TrainerConfig(**{**vars(cfg.trainer), "api_url": received.api_url, "vllm_server_port": received.vllm_server_port,
                                        "output_dir": str(tmp_path / "run")})
    assert received.vllm_server_port != TrainerConfig.vllm_server_port  # a free port the launcher picked


@pytest.mark.parametrize("argv", [["--profile", "fastest-8b", "--staged-step", "false"],  # back to its default
                                  ["--profile", "offload-grads"], ["--profile", "lean", "--optimizer", "adamw4bit"]])
def test_a_profile_and_the_flags_beside_it_reach_the_trainer_as_the_launcher_read_them(argv):
    from example_trainer.launcher import trainer_flags

    read = parse_loop_config(argv).trainer
    assert parse_config(TrainerConfig, trainer_flags(read)) == read


def test_a_trainer_setting_the_launcher_makes_itself_is_refused_with_its_flag():
    with pytest.raises(ValueError, match="sets the trainer's --output-dir itself: give --run-dir"):
        LoopConfig(trainer=TrainerConfig(output_dir="elsewhere"))
    with pytest.raises(SystemExit):  # not a launcher flag: argparse refuses it
        parse_loop_config(["--output-dir", "elsewhere"])


def test_the_launchers_output_says_within_a_minute_that_the_environments_drop_every_group(tmp_path, monkeypatch,
                                                                                          capsys):
    """Seen with a tiny random model: every group dropped (all scores equal) for 8 minutes, and the
    launcher printed nothing of it: its echo showed no "[trainer] waited ..." warning of the
    trainer's log. The line as the trainer writes it, through the launcher's default echo."""
    from example_trainer.data import api_client
    from example_trainer.grpo import log_format
    from example_trainer.launcher import _Echo

    class DroppingApi:  # GET /status of an API whose environment dropped 918 groups since the wait began
        calls = 0

        def status(self) -> dict:
            DroppingApi.calls += 1
            return {"dropped": {"dropped_equal_scores": 0 if DroppingApi.calls == 1 else 918}, "queue_size": 0}

    assert api_client.DROPS_REPORT_SECONDS <= 60  # the report comes within a minute of waiting
    monkeypatch.setattr(api_client, "DROPS_REPORT_SECONDS", 0.0)
    log = tmp_path / "trainer.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter(log_format()))
    trainer_logger = logging.getLogger("onecopy.trainer")
    trainer_logger.addHandler(handler)
    try:
        watch = api_client.DropWatch(DroppingApi())
        watch.check()  # the totals at the wait's start
        watch.check()  # the report
        # Another rank's wait for rank 0's batch, which rank 0's own line above already says.
        logging.getLogger("onecopy.trainer.parallel").warning("[parallel] rank 1 has waited 60 s for its batch")
    finally:
        trainer_logger.removeHandler(handler)
        handler.close()
    assert "dropped 918 groups" in log.read_text()
    with _Echo(log, LoopConfig().echo):
        pass
    printed = capsys.readouterr().out
    assert "the environments dropped 918 groups meanwhile" in printed
    assert "dropped_equal_scores" in printed and "--env.ensure_scores_are_not_same false" in printed
    assert "has waited" in log.read_text() and "has waited" not in printed
