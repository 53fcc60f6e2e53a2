"""The API's whole state in one SQLite file: trainer registration, environments, queue, step.

Durability. The database runs in WAL mode with `synchronous=FULL`: every commit fsyncs the WAL
before the request is answered, so a group acknowledged with 2xx survives `kill -9` and a power
cut alike. (With NORMAL in WAL mode a killed process loses nothing either, since the WAL sits in
the OS page cache, but a power cut can drop the last commits; one fsync per post is cheap next to
generating a group.) A batch is chosen, deleted from the queue and counted as a step (unless the
trainer counts its steps itself) in one transaction, so after a crash a group is either still
queued or was served, never both: the trainer gets each group at most once, the environment's post
is kept exactly once.

Concurrency. FastAPI runs these methods from a thread pool; one connection guarded by a lock
serialises them, which SQLite would do for writers anyway.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from api.batching import pick_exact
from api.errors import GroupRejected, TrainerNotRegistered, UnknownEnv
from api.models import RegisterEnv, Registration, ScoredData
from api.validation import Limits, check_group

logger = logging.getLogger("onecopy.api.store")
# A trainer asks for a batch every 50 ms while it waits: a queue that cannot fill one is said once
# in this many seconds, not twenty times a second.
STUCK_WARNING_SECONDS = 10.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS trainer (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    uuid TEXT NOT NULL,
    registration TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS envs (
    env_id INTEGER PRIMARY KEY,
    wandb_name TEXT NOT NULL,
    base_name TEXT NOT NULL,
    registration TEXT NOT NULL,
    connected INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS queue (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env_id INTEGER,
    size INTEGER NOT NULL,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS seen_groups (group_uuid TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS latest (id INTEGER PRIMARY KEY CHECK (id = 1), payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class Trainer:
    uuid: str
    registration: Registration


@dataclass(frozen=True)
class Env:
    env_id: int
    wandb_name: str
    registration: RegisterEnv
    connected: bool


@dataclass(frozen=True)
class EnvAdmission:
    """What /register-env answers: the new env, the trainer it joins and the current step."""

    env: Env
    trainer: Trainer
    step: int


@dataclass(frozen=True)
class Stored:
    stored: int
    duplicates: int
    queue_size: int


@dataclass(frozen=True)
class QueueStatus:
    """GET /status's numbers, read at one instant. `batch_ready`: whether GET /batch would serve a
    batch now (None while no trainer is registered); queued sequences alone cannot say, since a
    batch is groups adding up to exactly batch_size."""

    step: int
    groups: int
    sequences: int
    batch_ready: bool | None


@dataclass(frozen=True)
class ServedBatch:
    """Groups as posted (JSON text, oldest first), and the step count after serving them."""

    payloads: list[str]
    step: int
    sequences: int


@dataclass(frozen=True)
class Overview:
    """A consistent read for /status-env: step, environments, and (env_id, size) per queued group."""

    step: int
    envs: list[Env]
    queued: list[tuple[int | None, int]]


def _encode(group: ScoredData) -> str:
    return json.dumps(group.model_dump(mode="json"), separators=(",", ":"), allow_nan=False)


class TrajectoryStore:
    """Durable state of the trajectory API. Open one per process; call `close()` at shutdown."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._stuck_warned_at = -math.inf  # when the queue last could not fill a batch (warned once a while)
        # Groups each environment dropped, by reason: counters for a waiting trainer's log, not
        # state to keep (an environment reports its totals again after a restart of the API).
        self._dropped: dict[int, dict[str, int]] = {}
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as error:
            self._db.close()
            raise RuntimeError(f"{self.path} is not a usable SQLite database ({error}); point "
                               "--db-path at a new file or at a database this API created") from error
        if mode != "wal":
            self._db.close()
            raise RuntimeError(f"SQLite kept journal_mode={mode} for {self.path}, not WAL; put "
                               "--db-path on a local filesystem")
        with self._reading() as db:
            step, queue_size = self._step(db), self._queue_size(db)
        logger.info("[API] store opened path=%s queue=%d step=%d trainer=%s", self.path, queue_size,
                    step, "registered" if self.trainer() else "none")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    @staticmethod
    def _advance_step(db: sqlite3.Connection) -> None:
        db.execute("UPDATE counters SET value = value + 1 WHERE name = 'step'")

    @staticmethod
    def _step(db: sqlite3.Connection) -> int:
        row = db.execute("SELECT value FROM counters WHERE name = 'step'").fetchone()
        return row[0] if row else 0

    @staticmethod
    def _queue_size(db: sqlite3.Connection) -> int:
        return db.execute("SELECT COUNT(*) FROM queue").fetchone()[0]

    @staticmethod
    def _pick(db: sqlite3.Connection, batch_size: int, window: int) -> tuple[list[int], list[int] | None]:
        """(ids of the `window` oldest groups that fit in a batch, positions among them of the
        groups the next batch takes, or None when none add up to batch_size)."""
        rows = db.execute("SELECT id, size FROM queue WHERE size <= ? ORDER BY id LIMIT ?",
                          (batch_size, window)).fetchall()
        return [row[0] for row in rows], pick_exact([row[1] for row in rows], batch_size)

    @staticmethod
    def _trainer(db: sqlite3.Connection) -> Trainer | None:
        row = db.execute("SELECT uuid, registration FROM trainer WHERE id = 1").fetchone()
        if row is None:
            return None
        return Trainer(row[0], Registration.model_validate_json(row[1]))

    @staticmethod
    def _envs(db: sqlite3.Connection) -> list[Env]:
        rows = db.execute(
            "SELECT env_id, wandb_name, registration, connected FROM envs ORDER BY env_id"
        ).fetchall()
        return [Env(r[0], r[1], RegisterEnv.model_validate_json(r[2]), bool(r[3])) for r in rows]

    def trainer(self) -> Trainer | None:
        with self._reading() as db:
            return self._trainer(db)

    def report_dropped(self, env_id: int, counts: dict[str, int]) -> None:
        """Remember environment ``env_id``'s totals of dropped groups, by reason."""
        with self._lock:
            self._dropped[env_id] = dict(counts)

    def dropped(self) -> dict[str, int]:
        """Dropped groups by reason, summed over the environments."""
        with self._lock:
            totals: dict[str, int] = {}
            for counts in self._dropped.values():
                for reason, n in counts.items():
                    totals[reason] = totals.get(reason, 0) + n
            return totals

    def status(self, window: int) -> QueueStatus:
        """Step, queued groups and sequences, and whether a batch is ready among the `window`
        oldest groups (as `take_batch(window)` would look for one)."""
        with self._reading() as db:
            groups, sequences = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM queue").fetchone()
            trainer = self._trainer(db)
            ready = None
            if trainer is not None:
                ready = self._pick(db, trainer.registration.batch_size, window)[1] is not None
            return QueueStatus(self._step(db), groups, sequences, ready)

    def register_trainer(self, registration: Registration) -> Trainer:
        """Replace the trainer's registration; the step restarts at its starting_step."""
        trainer = Trainer(str(uuid.uuid4()), registration)
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO trainer (id, uuid, registration) VALUES (1, ?, ?)",
                (trainer.uuid, registration.model_dump_json()),
            )
            db.execute("INSERT OR REPLACE INTO counters (name, value) VALUES ('step', ?)",
                       (registration.starting_step,))
            too_big = db.execute("SELECT COUNT(*) FROM queue WHERE size > ?",
                                 (registration.batch_size,)).fetchone()[0]
        if too_big:
            logger.warning("[API] %d queued groups are larger than batch_size=%d and will not be "
                           "served until a trainer registers a larger batch_size",
                           too_big, registration.batch_size)
        return trainer

    def register_env(self, registration: RegisterEnv) -> EnvAdmission | None:
        """Give the environment the next id; None while no trainer is registered."""
        with self._transaction() as db:
            trainer = self._trainer(db)
            if trainer is None:
                return None
            env_id = db.execute("SELECT COALESCE(MAX(env_id) + 1, 0) FROM envs").fetchone()[0]
            base = registration.desired_name or "env"
            same = db.execute("SELECT COUNT(*) FROM envs WHERE base_name = ?", (base,)).fetchone()[0]
            env = Env(env_id, f"{base}_{same}", registration, connected=True)
            db.execute(
                "INSERT INTO envs (env_id, wandb_name, base_name, registration) VALUES (?, ?, ?, ?)",
                (env_id, env.wandb_name, base, registration.model_dump_json()),
            )
            return EnvAdmission(env, trainer, self._step(db))

    def disconnect_env(self, env_id: int) -> None:
        with self._transaction() as db:
            if db.execute("UPDATE envs SET connected = 0 WHERE env_id = ?", (env_id,)).rowcount == 0:
                raise UnknownEnv(env_id)

    def overview(self, env_id: int) -> Overview:
        """Everything /status-env needs, read at one instant; UnknownEnv if `env_id` is not known."""
        with self._reading() as db:
            envs = self._envs(db)
            if all(env.env_id != env_id for env in envs):
                raise UnknownEnv(env_id)
            queued = db.execute("SELECT env_id, size FROM queue ORDER BY id").fetchall()
            return Overview(self._step(db), envs, [(row[0], row[1]) for row in queued])

    def add_groups(self, groups: list[ScoredData], *, indexed: bool) -> Stored:
        """Queue every group or none of them.

        Groups whose group_uuid was seen before (or earlier in `groups`) are skipped and counted
        as duplicates. `indexed` adds each group's position to error locations (/scored_data_list).
        Raises TrainerNotRegistered, GroupRejected or UnknownEnv.
        """
        payloads = [_encode(group) for group in groups]
        with self._transaction() as db:
            trainer = self._trainer(db)
            if trainer is None:
                raise TrainerNotRegistered()
            limits = Limits(trainer.registration.batch_size, trainer.registration.max_token_len)
            env_ids = {row[0] for row in db.execute("SELECT env_id FROM envs")}
            keys: set[str] = set()
            fresh: list[int] = []
            for i, group in enumerate(groups):
                key = group.group_uuid
                if key is not None and (key in keys or db.execute(
                        "SELECT 1 FROM seen_groups WHERE group_uuid = ?", (key,)).fetchone()):
                    continue
                try:
                    check_group(group, limits)
                except GroupRejected as rejected:
                    if indexed:
                        raise rejected.at_index(i) from None
                    raise
                if group.env_id is not None and group.env_id not in env_ids:
                    raise UnknownEnv(group.env_id, f"[{i}].env_id" if indexed else "env_id")
                if key is not None:
                    keys.add(key)
                fresh.append(i)

            db.executemany("INSERT INTO seen_groups (group_uuid) VALUES (?)", [(k,) for k in keys])
            db.executemany(
                "INSERT INTO queue (env_id, size, payload) VALUES (?, ?, ?)",
                [(groups[i].env_id, len(groups[i].tokens), payloads[i]) for i in fresh],
            )
            if fresh:
                db.execute("INSERT OR REPLACE INTO latest (id, payload) VALUES (1, ?)",
                           (payloads[fresh[-1]],))
            queue_size = self._queue_size(db)
        return Stored(len(fresh), len(groups) - len(fresh), queue_size)

    def take_batch(self, window: int, count_step: bool = True) -> ServedBatch | None:
        """Remove and return groups adding up to exactly batch_size; None if none add up.

        Only the `window` oldest groups that fit in a batch are considered. The step counts the
        batch unless ``count_step`` is false (the trainer then counts with ``count_step()``).
        """
        with self._transaction() as db:
            trainer = self._trainer(db)
            if trainer is None:
                return None
            batch_size = trainer.registration.batch_size
            fitting, picked = self._pick(db, batch_size, window)
            if picked is None:
                if len(fitting) == window and time.monotonic() - self._stuck_warned_at >= STUCK_WARNING_SECONDS:
                    self._stuck_warned_at = time.monotonic()
                    logger.warning("[API] the oldest %d groups cannot add up to batch_size=%d; "
                                   "raise --batch-window or post groups whose sizes fill a batch",
                                   window, batch_size)
                return None
            ids = [fitting[i] for i in picked]
            payloads = [db.execute("SELECT payload FROM queue WHERE id = ?", (i,)).fetchone()[0]
                        for i in ids]
            db.executemany("DELETE FROM queue WHERE id = ?", [(i,) for i in ids])
            if count_step:
                self._advance_step(db)
            return ServedBatch(payloads, self._step(db), batch_size)

    def count_step(self) -> tuple[int, int]:
        """Count one step without serving a batch; (the new step, queued groups)."""
        with self._transaction() as db:
            self._advance_step(db)
            return self._step(db), self._queue_size(db)

    def latest(self) -> str | None:
        """The last group queued, as posted (JSON text), even if it was served since."""
        with self._reading() as db:
            row = db.execute("SELECT payload FROM latest WHERE id = 1").fetchone()
            return row[0] if row else None

    def reset(self) -> None:
        """Forget everything: queue, trainer, environments, seen group_uuids, step."""
        with self._transaction() as db:
            for table in ("trainer", "envs", "queue", "seen_groups", "latest", "counters"):
                db.execute(f"DELETE FROM {table}")
