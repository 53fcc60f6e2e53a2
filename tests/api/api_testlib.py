"""Plain helpers the API tests share: valid groups and trainer registration."""

from __future__ import annotations

BATCH_SIZE = 8
MAX_TOKEN_LEN = 16


def make_group(size: int, length: int = 3, tag: int = 0, **fields: object) -> dict:
    """A valid group of `size` sequences of `length` tokens; `tag` is written into every token
    so a test can tell groups apart after they are served."""
    return {
        "tokens": [[tag] * length for _ in range(size)],
        "masks": [[-100] + [tag] * (length - 1) for _ in range(size)],
        "scores": [float(i) for i in range(size)],
        **fields,
    }


def register_trainer(client, batch_size: int = BATCH_SIZE, max_token_len: int = MAX_TOKEN_LEN,
                     **fields: object):
    body = {"batch_size": batch_size, "max_token_len": max_token_len, "num_steps": 100, **fields}
    response = client.post("/register", json=body)
    assert response.status_code == 200, response.text
    return response


def queue_size(client) -> int:
    return client.get("/status").json()["queue_size"]
