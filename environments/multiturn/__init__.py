"""Multi-turn environments with token ids in and out.

The pieces, in the order an episode uses them:

- `ledger.py`: `EpisodeLedger`, the training rows of one episode. Sampled positions carry the
  token, vLLM's logprob and weights version; every other position (prompt, tool and environment
  messages) carries mask -100, logprob 1.0 and version -1. Each turn's prompt is the row so far;
  a history that does not extend the row closes it and starts the next, so no sampled token is
  trained twice or lost. `episodes_group` turns the rows of a group's episodes into one
  ScoredDataGroup whose baseline is taken over episodes, not rows (an episode scored None left out).
- `chat_codec.py`: `ChatCodec`, token ids from the tokenizer's chat template: the first prompt,
  and the ids that bridge a tool/environment message onto the sampled ids (the difference of two
  renders of a dummy conversation, cut at the end-of-turn token). A start-up self-test finds
  templates that rewrite history and switches them to re-rendering.
- `tool_calls.py`: tool calls parsed from the sampled ids (the tokenizer's `parse_response` when
  it has a response template, else the Qwen/ChatML `<tool_call>{json}</tool_call>` format).
- `episode.py`: `play_turns`, the turn loop of one episode; what answers each turn is a `Respond`.
- `factory.py`: TRL's `environment_factory` contract (reset(**row), public methods as tools,
  {"error": ...} tool messages, sync tools off the event loop); `ToolRunner` answers a turn
  with its tool calls' results and records what answering gave (`ToolStats`: error replies,
  seconds each); `play_turns` counts the calls themselves, once, for every tool metric.
- `multiturn_env.py`: `MultiTurnEnv(BaseEnv)`: groups of concurrent episodes, scored by
  get_reward() or TRL-style reward functions with TRL's multi-turn arguments.
- `tool_env.py`: `ToolEnv`, a MultiTurnEnv over a TRL environment_factory class (tools answer).
- `chat_env.py`: `ChatEnv`, a MultiTurnEnv over a class whose step(text) replies (no tools).
- `openenv_session.py`: `OpenEnvSession`, one episode's session of an OpenEnv client (reset,
  step(text) -> the observation's text, the steps' rewards); environments/openenv_server.py runs it.
"""
