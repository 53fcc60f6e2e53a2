"""Fixtures for environment tests; the fakes themselves live in env_fakes.py."""

from __future__ import annotations

import pytest
from env_fakes import FAST, FakeApi, FakeInference, FakeServer, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


@pytest.fixture
def fake_inference(tokenizer):
    inference = FakeInference(tokenizer)
    server = FakeServer(inference).start()
    inference.server = server
    yield inference
    server.stop()


@pytest.fixture
def fake_api():
    api = FakeApi()
    server = FakeServer(api).start()
    api.server = server
    yield api
    server.stop()


@pytest.fixture
def make_env(tokenizer):
    """Factory of a tiny BaseEnv: items 'q1', 'q2', ...; a completion scores 1.0 iff it is 'yes'."""
    from environments.base import BaseEnv
    from environments.config import BaseEnvConfig, ServerConfig

    class EchoEnv(BaseEnv):
        name = "echo"

        async def setup(self):
            self.n = 0

        async def get_next_item(self):
            self.n += 1
            return {"question": f"q{self.n}"}

        def build_messages(self, item):
            return [{"role": "user", "content": item["question"]}]

        def score_completion(self, item, completion):
            return 1.0 if completion == "yes" else 0.0

    def make(inference_url: str, api_url: str = "http://127.0.0.1:9", server_kw=None, **env_kw) -> BaseEnv:
        settings = {"group_size": 4, "max_token_length": 128, "max_tokens": 16, "tokenizer_name": "unused"}
        settings.update(env_kw)
        config = BaseEnvConfig(rollout_server_url=api_url, **settings)
        env = EchoEnv(
            config,
            ServerConfig(base_url=inference_url, timeout=5.0, **(server_kw or {})),
            tokenizer=tokenizer,
        )
        env.backoff = FAST
        env.status_poll_s = env.register_poll_s = 0.05
        return env

    return make
