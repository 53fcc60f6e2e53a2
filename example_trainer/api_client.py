"""The trainer's side of the trajectory API: register, then pull batches of scored groups."""

from __future__ import annotations

import logging
import os
import time

import requests

logger = logging.getLogger("onecopy.trainer.api")


class TrajectoryClient:
    """Small blocking client; retries while the API is down or the queue is short."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        key = api_key or os.environ.get("ONECOPY_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = timeout

    def _call(self, method: str, path: str, **kwargs) -> dict:
        response = requests.request(method, self.url + path, headers=self.headers, timeout=self.timeout, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"API {method} {path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    def register(self, batch_size: int, max_token_len: int, num_steps: int, starting_step: int = 0,
                 checkpoint_dir: str = "", wandb_project: str = "onecopy", wandb_group: str | None = None,
                 wait: float = 120.0) -> dict:
        """Register as the trainer; waits up to ``wait`` seconds for the API to come up."""
        body = {
            "wandb_group": wandb_group or "", "wandb_project": wandb_project, "batch_size": batch_size,
            "max_token_len": max_token_len, "checkpoint_dir": checkpoint_dir,
            "save_checkpoint_interval": 0, "starting_step": starting_step, "num_steps": num_steps,
        }
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._call("POST", "/register", json=body)
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"trajectory API at {self.url} is not reachable: start it with `run-api`") from None
                time.sleep(1.0)

    def get_batch(self, timeout: float, poll: float = 0.5, while_waiting=lambda: None) -> list[dict]:
        """Block until the API serves a batch (a list of groups); raise after ``timeout`` seconds.
        ``while_waiting()`` runs between polls."""
        deadline = time.monotonic() + timeout
        announced = False
        while time.monotonic() < deadline:
            while_waiting()
            try:
                batch = self._call("GET", "/batch").get("batch")
            except requests.ConnectionError:
                batch = None
                logger.warning("[trainer] API at %s unreachable; retrying", self.url)
                time.sleep(2.0)
            if batch:
                return batch
            if not announced:
                logger.info("[trainer] waiting for a batch from %s", self.url)
                announced = True
            time.sleep(poll)
        raise TimeoutError(f"no batch from {self.url} in {timeout:.0f} s: is an environment running and posting groups?")
