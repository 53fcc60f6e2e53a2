"""The environment command line: flags from the config dataclasses, YAML, errors, process runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from env_fakes import FakeInference, FakeServer

from environments.arithmetic_server import ArithmeticEnv
from environments.cli import parse_configs, run_cli
from environments.gsm8k_server import GSM8kEnv

ROOT = Path(__file__).parents[2]


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "env:\n  group_size: 4\n  temperature: 0.7\n  difficulty: 3\n"
        "openai:\n  base_url: http://10.0.0.1:9001\n  timeout: 5\n"
    )
    command, env, server = parse_configs(
        ArithmeticEnv, ["serve", "--config", str(cfg), "--env.group_size", "6", "--openai.timeout", "7.5"]
    )
    assert command == "serve"
    assert (env.group_size, env.temperature, env.difficulty) == (6, 0.7, 3)  # flag, YAML, YAML
    assert env.max_tokens == 256 and env.rollout_server_url == "http://127.0.0.1:8000"  # defaults
    assert (server.base_url, server.timeout) == ("http://10.0.0.1:9001", 7.5)


def test_bool_and_optional_flags():
    _, env, _ = parse_configs(
        ArithmeticEnv,
        [
            "serve",
            "--env.use_wandb",
            "--env.ensure_scores_are_not_same",
            "false",
            "--env.total_steps",
            "none",
        ],
    )
    assert env.use_wandb is True and env.ensure_scores_are_not_same is False and env.total_steps is None


def test_absent_flags_keep_yaml_values_and_given_ones_win(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("env:\n  use_wandb: true\n  ensure_scores_are_not_same: false\n  total_steps: 5\n  seed: 3\n")
    argv = ["serve", "--config", str(cfg), "--env.use_wandb", "false", "--env.seed", "none"]
    _, env, _ = parse_configs(ArithmeticEnv, argv)
    assert (env.use_wandb, env.seed) == (False, None)  # given on the command line
    assert (env.ensure_scores_are_not_same, env.total_steps) == (False, 5)  # absent: the YAML's


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--env.group_size", "many"], "argument --env.group_size: expected an integer, got 'many'"),
        (["serve", "--env.use_wandb", "maybe"], "argument --env.use_wandb: expected true or false"),
        (["serve", "--env.use-wandb"], "unrecognized arguments: --env.use-wandb"),  # Atropos's snake_case
        (["serve", "--env.grup_size", "4"], "unrecognized arguments: --env.grup_size"),
        (["serve", "--env.group_size", "0"], "--env.group_size: must be >= 1, got 0"),
        (["serve", "--env.difficulty", "12"], "--env.difficulty: must be 1 to 9 digits, got 12"),
        (["serve", "--openai.base_url", "localhost:9001"], "--openai.base_url: must start with http://"),
        (["serve", "--env.max_tokens", "600"], "--env.max_tokens: must be < max_token_length (512)"),
        (["process", "--env.data_path_to_save_groups", "x.jsonl"], "process needs --env.total_steps"),
        (["process", "--env.total_steps", "2"], "process needs --env.data_path_to_save_groups"),
        (["launch"], "invalid choice: 'launch'"),
    ],
)
def test_bad_input_exits_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_configs(ArithmeticEnv, argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("env:\n  group_sise: 4\n", "unknown key env.group_sise"),
        ("env:\n  group_size: four\n", "env.group_size: expected an integer, got 'four'"),
        ("env:\n  group_size: 4.5\n", "env.group_size: expected an integer, got 4.5"),
        ("trainer:\n  lr: 1\n", "unknown section(s) ['trainer']"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_bad_yaml_exits_naming_the_key(tmp_path, yaml_text, message, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(SystemExit):
        parse_configs(ArithmeticEnv, ["serve", "--config", str(cfg)])
    assert message in capsys.readouterr().err


def test_yaml_openai_as_a_list_of_one_like_atropos(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("openai:\n  - base_url: http://127.0.0.1:9100\n")
    _, _, server = parse_configs(GSM8kEnv, ["serve", "--config", str(cfg)])
    assert server.base_url == "http://127.0.0.1:9100"


def test_help_text_comes_from_field_metadata(capsys):
    with pytest.raises(SystemExit):
        parse_configs(ArithmeticEnv, ["serve", "--help"])
    out = capsys.readouterr().out
    assert "--env.difficulty" in out and "digits per operand" in out and "--openai.base_url" in out


def test_process_subcommand_writes_jsonl(tokenizer, tokenizer_dir, tmp_path):
    server = FakeServer(FakeInference(tokenizer, answer_arithmetic=True)).start()
    out = tmp_path / "groups.jsonl"
    try:
        run_cli(
            ArithmeticEnv,
            [
                "process",
                "--env.tokenizer_name",
                tokenizer_dir,
                "--env.total_steps",
                "3",
                "--env.group_size",
                "4",
                "--env.seed",
                "1",
                "--env.data_path_to_save_groups",
                str(out),
                "--openai.base_url",
                server.url,
            ],
        )
    finally:
        server.stop()
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 3
    assert all(g["scores"] == [1.0, 0.0, 1.0, 0.0] for g in groups)


def test_evaluate_subcommand_reports_accuracy(tokenizer, tokenizer_dir, caplog):
    caplog.set_level("INFO", logger="onecopy.env")
    server = FakeServer(FakeInference(tokenizer, answer_arithmetic=True)).start()  # choice 0 is right
    try:
        metrics = run_cli(
            ArithmeticEnv,
            [
                "evaluate",
                "--env.tokenizer_name",
                tokenizer_dir,
                "--env.num_eval_items",
                "5",
                "--openai.base_url",
                server.url,
            ],
        )
    finally:
        server.stop()
    assert metrics == {"env/eval_accuracy": 1.0, "env/eval_items": 5.0}
    # and logs them as one JSON line, which scripts read back (bench/learning_run.py)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[env] eval metrics ")]
    assert [json.loads(line.removeprefix("[env] eval metrics ")) for line in logged] == [metrics]


def test_missing_tokenizer_folder_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="--env.tokenizer_name"):
        run_cli(
            ArithmeticEnv,
            [
                "process",
                "--env.tokenizer_name",
                str(tmp_path / "nope"),
                "--env.total_steps",
                "1",
                "--env.data_path_to_save_groups",
                str(tmp_path / "g.jsonl"),
            ],
        )


@pytest.mark.timeout(120)
def test_python_dash_m_entry_point(tokenizer, tokenizer_dir, tmp_path):
    server = FakeServer(FakeInference(tokenizer, answer_arithmetic=True)).start()
    out = tmp_path / "groups.jsonl"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "environments.arithmetic_server",
                "process",
                "--env.tokenizer_name",
                tokenizer_dir,
                "--env.total_steps",
                "2",
                "--env.group_size",
                "2",
                "--env.data_path_to_save_groups",
                str(out),
                "--openai.base_url",
                server.url,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=110,
            # ROOT first, then whatever path the running Python was given (a GPU image's site folder)
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        )
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 2
    assert "[env] wrote group score_mean=0.500" in proc.stderr
