"""Train on an OpenEnv environment, its code unchanged: its server (the ASGI app it builds with
openenv's `create_app`) runs as our child on 127.0.0.1, and each episode is one session of its own
client (an `EnvClient` subclass, or openenv's `GenericEnvClient`), the episodes of a group at once.

    python -m environments.openenv_server serve --env.app my_env.server.app:app \\
        --env.client my_env.client:MyEnv --env.action my_env.models:MyAction --env.action_field message \\
        --env.observation_field prompt --env.group_size 8 --env.max_turns 4

An episode (a ChatEnv: the environment's observation is the next user turn; no tools):

    reset(seed=<item seed>)  ->  the observation as text: the first user message (after --env.system_prompt)
    the model's reply        ->  Action(**{action_field: reply})  ->  step  ->  the observation as the next
                                 user message, until the environment says done (or max_turns, or a full context)
    the steps' rewards       ->  the episode's score (--env.episode_reward last | sum)

Token ids in and out are the multi-turn ledger's (environments/multiturn/): the sampled ids are
trained as sampled, the observations are masked context. An episode whose session fails (the
server died, the socket broke) fails its group whole: nothing of it is posted (openenv_session.py).

openenv is an optional extra that needs its own package folder (requirements-openenv.txt):
`--env.openenv_path` puts that folder first on this process's path and the server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import sys
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from environments.base import Item, seeded_items
from environments.config import ConfigError, check_eval_seed, opt
from environments.multiturn.chat_codec import Message
from environments.multiturn.chat_env import ChatEnv
from environments.multiturn.multiturn_env import MultiTurnEnvConfig
from environments.multiturn.openenv_session import EPISODE_REWARDS, OpenEnvSession, OpenEnvTurns, observation_text
from environments.openenv_host import OpenEnvServer

INSTALL_HINT = ("install the optional extra: pip install --no-deps --target .venv/openenv-extra -r "
                "requirements-openenv.txt, then pass --env.openenv_path .venv/openenv-extra")


def load_object(path: str, what: str) -> Any:
    """The object named by "module:attribute" (`what` says which flag named it, for the error)."""
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ConfigError(what, f"must be 'module:attribute', got {path!r}")
    try:
        return getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as exc:
        hint = f"; {INSTALL_HINT}" if exc.name and exc.name.split(".")[0] in ("openenv", "fastmcp", "mcp") else ""
        raise ConfigError(what, f"cannot import {module!r} ({exc}){hint}") from exc
    except AttributeError as exc:
        raise ConfigError(what, f"{module!r} has no {attribute!r}") from exc


@dataclass
class OpenEnvServerConfig(MultiTurnEnvConfig):
    """`--env.*` of every OpenEnv environment: its server, its client, its sessions, its rewards."""

    app: str = opt("", "the environment's ASGI app built with openenv's create_app, as module:attribute "
                   "(served on 127.0.0.1 by a child process of this one)")
    client: str = opt("openenv.core:GenericEnvClient", "the environment's client class (an openenv EnvClient "
                      "subclass), as module:attribute; each episode opens one session with it")
    observation_field: str = opt("", "the observation field shown to the model; empty: every field but done, "
                                 "reward and metadata, as JSON")
    episode_reward: str = opt("last", "the episode's score from its steps' rewards: last (the last step's, as "
                              "openenv's StepEnvSessionAdapter) or sum")
    system_prompt: str = opt("", "a system message before the first observation (empty: none)")
    openenv_path: str = opt("", "a folder put first on the path of this process and the server (where the "
                            "optional extra was installed with pip --target); empty: openenv is importable as is")
    max_sessions: int = opt(0, "most client sessions open at once, episodes beyond it wait for one to end: the "
                            "app's max_concurrent_envs (the server refuses more); 0: no cap")
    server_start_timeout: float = opt(60.0, "seconds to wait for the OpenEnv server's /health")
    max_turns: int = opt(4, "most model turns per episode; the environment's observation answers each")
    eval_seed: int = opt(1_000_003, "seed of the held-out eval episodes' reset seeds (must differ from --env.seed)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.episode_reward not in EPISODE_REWARDS:
            raise ConfigError("episode_reward", f"must be one of {', '.join(EPISODE_REWARDS)}, "
                              f"got {self.episode_reward!r}")
        if self.max_sessions < 0:
            raise ConfigError("max_sessions", f"must be >= 0 (0: no cap), got {self.max_sessions}")
        if self.server_start_timeout <= 0:
            raise ConfigError("server_start_timeout", f"must be > 0, got {self.server_start_timeout}")
        check_eval_seed(self.seed, self.eval_seed)


@dataclass
class OpenEnvEnvConfig(OpenEnvServerConfig):
    """`--env.*` of an OpenEnv chat environment: the server's, and how the model's reply becomes an Action."""

    action: str = opt("", "the environment's Action class, as module:attribute; empty: a dict (for GenericEnvClient)")
    action_field: str = opt("message", "the Action field that takes the model's reply")


def reset_item(rng) -> dict[str, int]:
    """One item: the seed its episodes reset the environment with."""
    return {"seed": rng.randrange(2**31)}


class OpenEnvEnv(ChatEnv):
    """Episodes of an OpenEnv environment, one client session each (see the module docstring)."""

    name = "openenv"
    env_config_cls = OpenEnvEnvConfig
    session_cls: type[OpenEnvSession] = OpenEnvSession  # one per episode
    config: OpenEnvEnvConfig
    server: Optional[OpenEnvServer] = None
    turns: Optional[OpenEnvTurns] = None
    _slots: Optional[asyncio.Semaphore] = None  # --env.max_sessions; None: no cap

    async def setup(self) -> None:
        """Import the environment's classes, start its server, and draw the reset seeds."""
        cfg = self.config
        self.use_openenv_path()
        client_cls, make_action = load_object(cfg.client, "client"), self.make_action()
        url = await self.start_server()
        self.turns = OpenEnvTurns(
            new_client=functools.partial(client_cls, base_url=url),
            make_action=make_action,
            show=lambda observation: observation_text(observation, cfg.observation_field),
            episode_reward=cfg.episode_reward,
            server_exit=self.server.exit_code,
        )
        self.eval_items, self._rng = seeded_items(reset_item, cfg.eval_seed, cfg.num_eval_items or 16, self.seed)

    def use_openenv_path(self) -> None:
        """Check --env.app is named and put --env.openenv_path first on this process's path (before
        importing the environment's classes)."""
        cfg = self.config
        if not cfg.app:
            raise ConfigError("app", f"name the environment's create_app app as module:attribute ({INSTALL_HINT})")
        if cfg.openenv_path and cfg.openenv_path not in sys.path:
            sys.path.insert(0, cfg.openenv_path)

    async def start_server(self) -> str:
        """Start the environment's server and wait for its /health; its base URL."""
        cfg = self.config
        self.server = OpenEnvServer(cfg.app, cfg.openenv_path)
        self.server.launch()  # in the loop's thread: the child's parent-death signal follows the thread that started it
        return await asyncio.to_thread(self.server.wait_healthy, cfg.server_start_timeout)

    def make_action(self) -> Callable[[str], Any]:
        """The model's reply made the environment's Action (--env.action, --env.action_field)."""
        action_cls = load_object(self.config.action, "action") if self.config.action else None
        field = self.config.action_field

        def make_action(text: str) -> Any:
            return {field: text} if action_cls is None else action_cls(**{field: text})

        return make_action

    async def get_next_item(self) -> Item:
        """The next reset seed."""
        return reset_item(self._rng)

    def slots(self) -> contextlib.AbstractAsyncContextManager:
        """What an episode holds while its session is open: one of --env.max_sessions slots, or nothing."""
        if not self.config.max_sessions:
            return contextlib.nullcontext()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_sessions)
        return self._slots

    @contextlib.asynccontextmanager
    async def episode_environment(self, item: Item) -> AsyncIterator[tuple[Any, list[Message]]]:
        """A client session for the episode, reset with the item; closed when the episode ends."""
        if self.turns is None:
            raise RuntimeError("setup() starts the OpenEnv server; call it before playing episodes")
        async with self.slots(), self.session_cls(self.turns) as session:
            first = await session.reset(**item)
            system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
            yield session, [*system, {"role": "user", "content": first}]

    async def close_clients(self) -> None:
        """Close the clients, then stop the OpenEnv server by its PID."""
        try:
            await super().close_clients()
        finally:
            if self.server is not None:
                self.server.stop()


if __name__ == "__main__":
    OpenEnvEnv.cli()
