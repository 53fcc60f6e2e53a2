"""The trainer's side of the trajectory API: register, then pull batches of scored groups.

Served groups are parsed into ``api.models.ScoredData``, the model the API validates posts with,
rather than a trainer-side copy of it: one schema on both sides of the boundary, so a field the
API learns (atroposlib's ``distill_*``, say) reaches the trainer typed without a second list to
keep in step. The API checked each group when it was posted; checking again here costs little
next to a training step and guards against any other Atropos-compatible server in between
(Atropos's own API checks types, not that rows line up with tokens).
"""

from __future__ import annotations

import logging
import os
import time

import requests
from pydantic import ValidationError

from api.errors import GroupRejected, field_path
from api.models import Batch, ScoredData
from api.validation import check_shape

logger = logging.getLogger("onecopy.trainer.api")
# How often a waiting trainer asks for its batch. Short, since a step can sit idle up to one
# interval after its batch is ready; a local GET /batch costs about a millisecond.
BATCH_POLL_SECONDS = 0.05
# A trainer waiting this long for a batch asks the API why (the groups environments dropped), says
# so in its log, and again each time as long; it stops when every group of NOTHING_KEPT_STOP_SECONDS
# was dropped: a model that scores every completion alike does not start scoring otherwise.
DROPS_REPORT_SECONDS = 30.0
NOTHING_KEPT_STOP_SECONDS = 300.0
# What a trainer can do about each reason an environment drops groups for.
DROP_ADVICE = {
    "dropped_equal_scores": "every completion of a group scored the same (a model too weak or too random for the task, "
                            "or a reward function that returns one value): pass --env.ensure_scores_are_not_same false "
                            "to keep such groups (they train nothing), or an easier task or a stronger model",
    "skipped_too_long": "a group's prompt, or prompt and completion, was longer than the environment's "
                        "--env.max_token_length (its log gives the prompt's tokens), or no multi-turn episode had "
                        "both a sampled token and a reward: raise --env.max_token_length or shorten the prompt "
                        "(fewer --env.shots where the environment has them)",
    "skipped_bad_values": "a score or logprob was NaN or infinite",
}


class MalformedBatch(ValueError):
    """GET /batch served a group that breaks the ScoredData schema; none of the batch was used."""


def parse_batch(payload: object, source: str = "GET /batch") -> list[ScoredData] | None:
    """The groups of a /batch answer, typed and shape-checked; None (or []) when none were served.

    Raises MalformedBatch naming the first bad field as ``batch[g].<field>`` (group g of the
    batch), before the trainer builds a tensor from any of it.
    """
    try:
        groups = Batch.model_validate(payload).batch
    except ValidationError as error:
        first = error.errors()[0]
        where = field_path(first["loc"]) if first["loc"] else "answer"
        reason = str(first["msg"]).removeprefix("Value error, ")
        raise MalformedBatch(_malformed(source, f"{where}: {reason}")) from None
    for g, group in enumerate(groups or []):
        try:
            check_shape(group)
        except GroupRejected as rejected:
            where = field_path(("batch", g, *rejected.loc[1:]))
            raise MalformedBatch(_malformed(source, f"{where}: {rejected.reason}")) from None
    return groups


def _malformed(source: str, problem: str) -> str:
    return (f"{source} served a malformed batch, {problem}. Nothing of it was trained on; fix the "
            "environment that posted the group (or the server in between) and restart the trainer")


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

    def step_metrics(self) -> dict[str, float]:
        """Nothing to report: every batch is served as it comes."""
        return {}

    def count_step(self) -> None:
        """Count one training step at the API (environments stop at the trainer's last step)."""
        self._call("POST", "/step")

    def get_batch(self, timeout: float, poll: float = BATCH_POLL_SECONDS, while_waiting=lambda: None,
                  count_step: bool = True) -> list[ScoredData]:
        """Block until the API serves a batch (a list of typed groups); raise TimeoutError after
        ``timeout`` seconds, MalformedBatch if a served group breaks the schema (see
        ``parse_batch``). ``while_waiting()`` runs between polls. ``count_step=False``: the API
        does not count the batch as a step (``count_step()`` does, once the step's batch is full)."""
        deadline = time.monotonic() + timeout
        announced = False
        drops = DropWatch(self)
        while time.monotonic() < deadline:
            while_waiting()
            try:
                batch = parse_batch(self._call("GET", "/batch", params=None if count_step else {"count_step": "false"}),
                                    f"GET {self.url}/batch")
            except requests.ConnectionError:
                batch = None
                logger.warning("[trainer] API at %s unreachable; retrying", self.url)
                time.sleep(2.0)
            if batch:
                return batch
            if not announced:
                logger.info("[trainer] waiting for a batch from %s", self.url)
                announced = True
            drops.check()  # only once the trainer waits: a batch served at once costs no GET /status
            time.sleep(poll)
        raise TimeoutError(f"no batch from {self.url} in {timeout:.0f} s: is an environment running and posting groups?"
                           + drops.summary())

    def status(self) -> dict:
        """GET /status: the step, the queued groups and (onecopy's API) the groups the
        environments dropped, by reason."""
        return self._call("GET", "/status")


class DropWatch:
    """While the trainer waits for a batch: every DROPS_REPORT_SECONDS, log how many groups the
    environments dropped since the wait began and why; raise NothingKept once they dropped every
    group they made for NOTHING_KEPT_STOP_SECONDS."""

    def __init__(self, client: TrajectoryClient) -> None:
        self.client = client
        self.started = time.monotonic()
        self.next_report = self.started + DROPS_REPORT_SECONDS
        self.began = False  # the totals at the wait's start are read once, on the first check
        self.at_start: dict[str, int] | None = None
        self.queued_at_start: int | None = None
        self.latest: dict[str, int] = {}

    def check(self) -> None:
        now = time.monotonic()
        if not self.began:  # read once, even when it fails: not a GET /status every poll
            self.began = True
            self.at_start, self.queued_at_start = self._read()
            return
        if now < self.next_report:
            return
        self.next_report = now + DROPS_REPORT_SECONDS
        totals, queued = self._read()
        if totals is None:
            return
        self.latest = {reason: n - (self.at_start or {}).get(reason, 0) for reason, n in totals.items()}
        dropped = sum(self.latest.values())
        waited = now - self.started
        if not dropped:
            logger.info("[trainer] waited %.0f s for a batch; the environments dropped no group meanwhile", waited)
            return
        logger.warning("[trainer] waited %.0f s for a batch: the environments dropped %d groups meanwhile%s",
                       waited, dropped, self.summary())
        if waited >= NOTHING_KEPT_STOP_SECONDS and queued is not None and queued <= (self.queued_at_start or 0):
            raise NothingKept(f"no batch in {waited:.0f} s: the environments dropped all {dropped} groups they made"
                              f"{self.summary()}")

    def summary(self) -> str:
        """'; by reason: N (why, what to do), ...' for the drops seen, or ''."""
        parts = [f"{n} {reason} ({DROP_ADVICE.get(reason, reason)})" for reason, n in self.latest.items() if n]
        return ("; " + "; ".join(parts)) if parts else ""

    def _read(self) -> tuple[dict[str, int] | None, int | None]:
        try:
            status = self.client.status()
        except (requests.ConnectionError, RuntimeError):
            return None, None
        return status.get("dropped"), status.get("queue_size")


class NothingKept(TimeoutError):
    """The environments dropped every group for NOTHING_KEPT_STOP_SECONDS: no batch will come."""
