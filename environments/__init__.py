"""Environments: turn items into scored groups of completions and post them to the trajectory API.

- `base.py`: BaseEnv (Atropos lifecycle: setup / get_next_item / collect_trajectories / evaluate)
- `runner.py`, `run_state.py`: EnvRunner (the serve / process / evaluate loops, given an env) and
  the RunState it updates
- `tokenizer.py`: the tokenizer folder: --env.tokenizer_name, else the inference server's model
- `config.py`, `cli.py`: typed `--env.*` / `--openai.*` configs and the command line built from them
- `config_flags.py`: flags from a config dataclass, the one builder the trainer and the API use too
- `clients.py`, `schemas.py`: HTTP clients with retries, and the typed bodies they send and read
- `arithmetic_server.py` (the default demo, no data) and `gsm8k_server.py` (math-verify)
- `multiturn/`: multi-turn, tool-using episodes with token ids in and out (the episode ledger, the
  chat codec, TRL-style `environment_factory` classes, `ToolEnv`); `calculator_tool_server.py` is its demo
"""
