"""Typed configuration of an environment: `--env.*` (BaseEnvConfig) and `--openai.*` (ServerConfig).

Each field carries its help text in `metadata["help"]`; `environments.cli` builds the command line
from these dataclasses (with `environments.config_flags`), so the help is written once, here.
`__post_init__` rejects bad values with a `ConfigError` that names the field; the CLI turns it into
`--env.<field>: ...`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

# ConfigError and `opt` (a field with its help in the metadata) live with the flag builder that reads them.
from environments.config_flags import ConfigError
from environments.config_flags import field as opt


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(field_name, message)



def json_object(field_name: str, text: str) -> dict:
    """A flag that holds a JSON object (``--env.task_config``, ``--env.taskset_args``), parsed; a
    ConfigError naming the field when it is not JSON or not an object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(field_name, f"is not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(field_name, f"must be a JSON object, got {text!r}")
    return value


def check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    """A ConfigError naming the field unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(field_name, f"must be one of {', '.join(choices)}, got {value!r}")


def check_eval_seed(seed: int | None, eval_seed: int) -> None:
    """``--env.eval_seed`` must differ from ``--env.seed``: drawn from the same seed, the training
    stream would repeat the held-out items."""
    if seed is not None and seed == eval_seed:
        raise ConfigError("eval_seed", f"must differ from seed ({seed}) to keep eval held out")

@dataclass
class BaseEnvConfig:
    """Settings every environment shares (`--env.*`). Subclass it to add environment fields."""

    group_size: int = opt(8, "completions per prompt; one /generate call with n=group_size")
    max_token_length: int = opt(
        512,
        "longest prompt+completion sent to the trainer; completions are cut to fit, longer groups skipped",
    )
    max_tokens: int = opt(256, "most tokens generated per completion")
    temperature: float = opt(1.0, "sampling temperature for training groups")
    top_p: float = opt(1.0, "nucleus sampling for training groups")
    total_steps: Optional[int] = opt(
        None,
        "groups to post (serve) or write (process); unset: serve runs until the trainer reaches "
        "its num_steps, or forever",
    )
    batch_size: Optional[int] = opt(
        None, "trainer batch size in sequences, for back-pressure; unset: asked from the API"
    )
    max_batches_offpolicy: int = opt(
        3, "pause generating while the sequences queued at the API plus group_size per group being "
        "generated fill this many trainer batches (0: never pause)"
    )
    tokenizer_name: Optional[str] = opt(
        None,
        "local tokenizer folder (must match the model vLLM serves); unset: the folder of the base "
        "model the inference server serves (its GET /v1/models)",
    )
    rollout_server_url: str = opt("http://127.0.0.1:8000", "trajectory API base URL")
    api_key: Optional[str] = opt(
        None, "bearer token for the trajectory API; unset: $ONECOPY_API_KEY, else no auth"
    )
    inference_weight: float = opt(1.0, "this environment's share of trainer batches (sent at registration)")
    use_wandb: bool = opt(False, "log env/ metrics to wandb (offline mode when WANDB_API_KEY is unset)")
    wandb_name: Optional[str] = opt(None, "name to register with the API and to use for the wandb run")
    ensure_scores_are_not_same: bool = opt(
        True, "drop groups whose scores are all equal (they carry no GRPO signal)"
    )
    data_path_to_save_groups: Optional[str] = opt(
        None, "JSONL file to write every kept group to (required by `process`; must not exist)"
    )
    max_num_workers: int = opt(2, "groups in flight at once")
    steps_per_eval: int = opt(0, "run evaluate() every this many trainer steps while serving (0: never)")
    num_eval_items: int = opt(64, "held-out items used by evaluate() (0: all that exist)")
    seed: Optional[int] = opt(None, "seed for item order and sampling; unset: a random one, logged")

    def __post_init__(self) -> None:
        _require(self.group_size >= 1, "group_size", f"must be >= 1, got {self.group_size}")
        _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _require(
            self.max_token_length > 1,
            "max_token_length",
            f"must be > 1, got {self.max_token_length}",
        )
        _require(
            self.max_tokens < self.max_token_length,
            "max_tokens",
            f"must be < max_token_length ({self.max_token_length}) to leave room for the prompt, "
            f"got {self.max_tokens}",
        )
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(
            self.total_steps is None or self.total_steps >= 1,
            "total_steps",
            f"must be >= 1 (or unset), got {self.total_steps}",
        )
        _require(
            self.batch_size is None or self.batch_size >= self.group_size,
            "batch_size",
            f"must be >= group_size ({self.group_size}) so a group fits in a batch, got {self.batch_size}",
        )
        _require(self.max_num_workers >= 1, "max_num_workers", f"must be >= 1, got {self.max_num_workers}")
        _require(self.max_batches_offpolicy >= 0, "max_batches_offpolicy", "must be >= 0")
        _require(self.steps_per_eval >= 0, "steps_per_eval", "must be >= 0")
        _require(self.num_eval_items >= 0, "num_eval_items", "must be >= 0")
        _require(
            self.rollout_server_url.startswith(("http://", "https://")),
            "rollout_server_url",
            f"must start with http:// or https://, got {self.rollout_server_url!r}",
        )

    def resolved_api_key(self) -> Optional[str]:
        """The API bearer token: the flag, else $ONECOPY_API_KEY, else None."""
        return self.api_key or os.environ.get("ONECOPY_API_KEY") or None


@dataclass
class ServerConfig:
    """The inference server (`--openai.*`): onecopy's vLLM server with its /generate endpoint."""

    base_url: str = opt("http://127.0.0.1:9001", "inference server base URL (serves POST /generate)")
    model_name: Optional[str] = opt(
        None, "sent as /generate's `model` (a served LoRA adapter's name); unset: the server's default"
    )
    timeout: float = opt(600.0, "seconds to wait for one /generate answer before retrying")
    num_max_requests_at_once: int = opt(16, "most /generate requests open at once (eval included)")

    def __post_init__(self) -> None:
        _require(
            self.base_url.startswith(("http://", "https://")),
            "base_url",
            f"must start with http:// or https://, got {self.base_url!r}",
        )
        _require(self.timeout > 0, "timeout", f"must be > 0, got {self.timeout}")
        _require(
            self.num_max_requests_at_once >= 1,
            "num_max_requests_at_once",
            f"must be >= 1, got {self.num_max_requests_at_once}",
        )
