"""The one flag builder (environments/config_flags.py) as the trainer and the API use it: one bool
syntax, none for optional values, choices, errors that name the flag, no secret in --help.
The environments' namespaced flags and YAML are tested in tests/environments/test_env_cli.py."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path
from typing import Optional

import pytest

from api.settings import API_KEY_ENV, ApiSettings
from environments.config_flags import add_dataclass_flags, coerce, field, parse_config
from example_trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_builder_imports_only_the_standard_library():
    # It must stay a leaf: example_trainer, api and environments all import it.
    imported = set()
    for node in ast.walk(ast.parse((ROOT / "environments" / "config_flags.py").read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            imported.add(node.module.split(".")[0])
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


@pytest.mark.parametrize("true, false", [("true", "false"), ("yes", "no"), ("on", "off"), ("1", "0"), ("True", "FALSE")])
def test_trainer_bools_bare_or_with_a_value(true, false):
    cfg = parse_config(TrainerConfig, ["--bf16-inplace", "--launch-vllm", false, "--benchmark", true])
    assert (cfg.bf16_inplace, cfg.launch_vllm, cfg.benchmark) == (True, False, True)
    assert parse_config(TrainerConfig, ["--resume"]).resume is True


def test_trainer_optional_none_and_choices():
    cfg = parse_config(TrainerConfig, ["--gradient-checkpointing", "none", "--wandb-group", "null",
                                       "--weight-bridge-mode", "none"])
    # Optional fields take none; a plain str field keeps the text ("none" is a bridge mode).
    assert (cfg.gradient_checkpointing, cfg.wandb_group, cfg.weight_bridge_mode) == (None, None, "none")
    assert parse_config(TrainerConfig, ["--gradient-checkpointing", "false"]).gradient_checkpointing is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--launch-vllm", "maybe"], "argument --launch-vllm: expected true or false, got 'maybe'"),
        (["--no-launch-vllm"], "unrecognized arguments: --no-launch-vllm"),  # one syntax: --launch-vllm false
        (["--optimizer", "adam"], "argument --optimizer: expected one of adamw, adamw8bit, adamwfp8, adamw4bit, got 'adam'"),
        (["--learning-rate", "fast"], "argument --learning-rate: expected a number, got 'fast'"),
        (["--lr", "fast"], "argument --lr: expected a number, got 'fast'"),  # an old name checks its value alike
        (["--batch-size", "6", "--gradient-accumulation-steps", "4"], "--batch-size 6 is not divisible"),
        (["--weight-bridge-mode", "none", "--launch-vllm", "false"], "drop --launch-vllm false"),
        (["--training-step", "3"], "unrecognized arguments: --training-step"),  # no abbreviations
    ],
)
def test_trainer_bad_input_exits_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(TrainerConfig, argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_trainer_help_shows_each_fields_help_and_default(capsys):
    with pytest.raises(SystemExit):
        parse_config(TrainerConfig, ["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--launch-vllm [BOOL] start (and restart) the vLLM server from the trainer (default: true)" in out
    assert "--optimizer {adamw,adamw8bit,adamwfp8,adamw4bit}" in out and "(default: 'What is 15 times 7?')" in out


def test_api_flags_fall_back_to_the_settings_defaults(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    settings = parse_config(ApiSettings, ["--port", "0", "--log-level", "debug"])
    assert (settings.port, settings.log_level, settings.db_path, settings.api_key) == (0, "DEBUG", "./onecopy_api.db",
                                                                                      "from-env")
    assert parse_config(ApiSettings, ["--api-key", "none"]).api_key is None  # auth off despite the variable


@pytest.mark.parametrize(
    "argv, message",
    [(["--port", "http"], "argument --port: expected an integer, got 'http'"),
     (["--port", "70000"], "port=70000 is outside 0..65535")],
)
def test_api_bad_input_exits_2(argv, message, capsys):
    from api.server import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_api_help_never_shows_the_key(monkeypatch, capsys):
    from api.server import main

    monkeypatch.setenv(API_KEY_ENV, "s3cret-token-value")
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0 and "--api-key" in out and "--db-path" in out and "(default: 8000)" in out
    assert "s3cret-token-value" not in out


def test_a_default_factory_is_not_called_for_help(capsys):
    calls = []

    @dataclasses.dataclass
    class Settings:
        token: Optional[str] = dataclasses.field(default_factory=lambda: calls.append(1) or "xyz",
                                                 metadata={"help": "a token"})
        verbose: bool = field(False, "say more")

    parser = argparse.ArgumentParser(prog="t")
    add_dataclass_flags(parser, Settings)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert calls == [] and "a token" in capsys.readouterr().out
    assert parse_config(Settings, ["--verbose", "off"]) == Settings(token="xyz", verbose=False)  # now it runs


def test_a_type_the_command_line_cannot_parse_is_refused_when_the_parser_is_built():
    @dataclasses.dataclass
    class Bad:
        names: list = dataclasses.field(default_factory=list, metadata={"help": "names"})

    with pytest.raises(TypeError, match="Bad.names"):
        add_dataclass_flags(argparse.ArgumentParser(), Bad)


@pytest.mark.parametrize(
    "value, tp, expected",
    [("Yes", bool, True), ("off", bool, False), (True, bool, True), ("7", int, 7), (7, float, 7.0),
     ("1e-5", float, 1e-5), ("none", Optional[int], None), (None, Optional[str], None), ("none", str, "none")],
)
def test_coerce_text_and_yaml_values(value, tp, expected):
    assert coerce(value, tp) == expected and type(coerce(value, tp)) is type(expected)


@pytest.mark.parametrize(
    "value, tp, choices, message",
    [(True, int, None, "expected an integer, got True"), (1, bool, None, "expected true or false, got 1"),
     (None, int, None, "expected an integer, got null"), ("4.5", int, None, "expected an integer, got '4.5'"),
     ("c", str, ("a", "b"), "expected one of a, b, got 'c'"), (3, str, None, "expected a string, got 3")],
)
def test_coerce_says_what_it_expected(value, tp, choices, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        coerce(value, tp, choices)


def test_every_mode_row_names_a_bridge_class_and_every_bridge_class_has_a_row():
    import inspect
    import pkgutil

    import example_trainer.bridges
    from example_trainer.bridges import bridge_class
    from example_trainer.bridges.base import WeightBridge
    from example_trainer.config import TrainerConfig
    from example_trainer.modes import MODES

    named = set()
    for name, mode in MODES.items():
        assert TrainerConfig(weight_bridge_mode=name).weight_bridge_mode == name  # a choice of the flag
        base = bridge_class(name)
        named.add(base)
        for parallel, _ in mode.parallel_bridges:  # a --parallel variant is its mode's class, refined
            assert parallel in mode.parallel and issubclass(bridge_class(name, parallel), base)
            named.add(bridge_class(name, parallel))
    concrete = set()
    for info in pkgutil.iter_modules(example_trainer.bridges.__path__):
        module = __import__(f"example_trainer.bridges.{info.name}", fromlist=["_"])
        concrete |= {cls for _, cls in inspect.getmembers(module, inspect.isclass)
                     if issubclass(cls, WeightBridge) and not inspect.isabstract(cls) and cls.__module__ == module.__name__}
    assert concrete - named == set(), "a bridge class no mode names"


@pytest.mark.parametrize("flags, message", [
    ({"weight_bridge_mode": "none", "launch_vllm": False}, "none starts and restarts vLLM itself: drop --launch-vllm"),
    ({"weight_bridge_mode": "lora_only", "bf16_inplace": True}, "--bf16-inplace steps vLLM's own bf16 tensors"),
    ({"weight_bridge_mode": "none", "parallel": "data"}, "--parallel data is not built for --weight-bridge-mode 'none'"),
    ({"parallel": "tensor", "beta": 0.1}, "--beta keeps a frozen whole-model copy .* not built for --parallel tensor"),
    ({"gate_timeout": 0}, "--gate-timeout must be > 0 seconds"),
])
def test_a_mode_refuses_the_flags_its_class_does_not_take(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**flags)


def test_trls_names_are_the_names_of_trls_concepts():
    """A concept TRL has carries TRL's name (GRPOConfig's learning_rate, beta, save_steps,
    save_total_limit, max_steps, output_dir, vllm_max_model_length, vllm_server_timeout,
    num_generations): the field, its flag, the config's dump."""
    from example_trainer.launcher import parse_loop_config

    cfg = parse_config(TrainerConfig, ["--learning-rate", "3e-6", "--beta", "0.04", "--save-steps", "5",
                                       "--save-total-limit", "3", "--vllm-max-model-length", "256"])
    assert (cfg.learning_rate, cfg.beta, cfg.save_steps, cfg.save_total_limit, cfg.vllm_max_model_length) == \
        (3e-6, 0.04, 5, 3, 256)
    assert {"learning_rate", "beta", "save_steps", "save_total_limit"} <= dataclasses.asdict(cfg).keys()
    loop = parse_loop_config(["--num-generations", "8", "--learning-rate", "1e-6"])
    assert (loop.num_generations, loop.trainer.learning_rate) == (8, 1e-6)


OLD_NAMES = [("--lr", "3e-6", "--learning-rate"), ("--kl-coef", "0.04", "--beta"),
             ("--checkpoint-interval", "5", "--save-steps"), ("--keep-last", "3", "--save-total-limit"),
             ("--vllm-max-model-len", "256", "--vllm-max-model-length"), ("--training-steps", "7", "--max-steps"),
             ("--save-path", "elsewhere", "--output-dir"), ("--vllm-start-timeout", "60", "--vllm-server-timeout"),
             ("--vllm-port", "9100", "--vllm-server-port")]


@pytest.mark.parametrize("old, value, new", OLD_NAMES)
def test_an_old_flag_name_still_sets_its_field_and_says_the_new_name_in_one_line(old, value, new, capsys):
    """A user's script written with the earlier names keeps working, and is told the name to use."""
    assert parse_config(TrainerConfig, [old, value]) == parse_config(TrainerConfig, [new, value])
    err = capsys.readouterr().err
    assert err == f"{old} is deprecated: use {new} (same meaning)\n"
    parse_config(TrainerConfig, [new, value])
    assert capsys.readouterr().err == ""  # the new name says nothing


def test_the_launchers_old_group_size_sets_num_generations_with_the_notice(capsys):
    from example_trainer.launcher import parse_loop_config

    assert parse_loop_config(["--group-size", "8"]).num_generations == 8
    assert capsys.readouterr().err == "--group-size is deprecated: use --num-generations (same meaning)\n"


def test_an_old_yes_no_flag_name_takes_the_same_forms_as_its_new_one(capsys):
    @dataclasses.dataclass
    class Switch:
        fast: bool = field(False, "go fast", old_names=("--quick",))

    assert parse_config(Switch, ["--quick"]).fast is True  # bare = true, as for --fast
    assert parse_config(Switch, ["--quick", "false"]).fast is False
    assert capsys.readouterr().err.count("--quick is deprecated: use --fast") == 2


@pytest.mark.parametrize("parse", ["trainer", "launcher"])
def test_help_shows_one_name_per_concept(parse, capsys):
    """--help lists only the current names: an old spelling is read, never advertised."""
    from example_trainer.launcher import parse_loop_config

    with pytest.raises(SystemExit):
        parse_config(TrainerConfig, ["--help"]) if parse == "trainer" else parse_loop_config(["--help"])
    out = capsys.readouterr().out
    absent = {"trainer": "--num-generations", "launcher": "--output-dir"}[parse]  # the launcher sets --output-dir
    # (the launcher's --vllm-server-port is its own, passed on as the trainer's)
    for old, _, new in [*OLD_NAMES, ("--group-size", "", "--num-generations")]:
        assert (f"{new} " in out) == (new != absent), new
        assert old + " " not in out and old + "," not in out and old + "/" not in out, old


def test_a_profile_sets_its_settings_and_a_flag_beside_it_wins():
    from example_trainer.config import TrainerConfig
    from example_trainer.profiles import PROFILES

    lean = parse_config(TrainerConfig, ["--profile", "lean"])
    assert (lean.bf16_inplace, lean.optimizer) == (True, "adamw8bit")
    assert parse_config(TrainerConfig, ["--profile", "lean", "--optimizer", "adamw4bit"]).optimizer == "adamw4bit"
    offload = parse_config(TrainerConfig, ["--profile", "offload-grads"])
    assert all(getattr(offload, key) == value for key, value in PROFILES["offload-grads"].items())
    assert parse_config(TrainerConfig, []).bf16_inplace is False  # no profile: the plain defaults


def test_an_unknown_profile_is_refused_with_the_known_ones(capsys):
    from example_trainer.config import TrainerConfig

    with pytest.raises(SystemExit):
        parse_config(TrainerConfig, ["--profile", "fastest"])
    assert "lean" in capsys.readouterr().err


def test_help_lists_the_common_flags_first_and_the_rare_memory_and_speed_knobs_under_their_own_heading(capsys):
    from example_trainer.config import ADVANCED, TrainerConfig

    with pytest.raises(SystemExit):
        parse_config(TrainerConfig, ["--help"])
    text = capsys.readouterr().out
    common, advanced = text.split(f"\n{ADVANCED}:\n")
    fields = dataclasses.fields(TrainerConfig)
    marked = {f.name for f in fields if f.metadata.get("section") == ADVANCED}
    assert {"bf16_inplace", "staged_step", "offload_optimizer", "torch_compile"} <= marked
    for f in fields:
        flag = "--" + f.name.replace("_", "-") + " "
        assert flag in (advanced if f.name in marked else common), f"{flag} is under the wrong heading"
    assert text.index("--weight-bridge-mode") < text.index("--bf16-inplace")  # the common ones first


def test_a_section_groups_flags_on_a_parser_and_is_ignored_inside_a_group():
    @dataclasses.dataclass
    class Knobs:
        plain: int = field(1, "a common flag")
        rare: int = field(2, "a rare one", section="advanced")

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Knobs, title="knobs")
    titles = {group.title: [a.dest for a in group._group_actions] for group in parser._action_groups}
    assert titles["knobs"] == ["plain"] and titles["knobs, advanced"] == ["rare"]
    inside = argparse.ArgumentParser().add_argument_group("env")
    add_dataclass_flags(inside, Knobs)
    assert [a.dest for a in inside._group_actions] == ["plain", "rare"]
    assert vars(parser.parse_args(["--rare", "5"])) == {"rare": 5}


def test_as_flags_gives_the_command_line_that_parses_back_into_the_config():
    from environments.config_flags import as_flags
    from example_trainer.config import TrainerConfig

    assert as_flags(TrainerConfig()) == []
    cfg = TrainerConfig(learning_rate=3e-6, bf16_inplace=True, wandb_group=None, epsilon_high=0.28, vllm_extra_args="--enforce-eager -O0",
                        max_off_policy_steps=None, probe_prompt="")
    assert parse_config(TrainerConfig, as_flags(cfg)) == cfg
