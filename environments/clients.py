"""HTTP clients of an environment: the inference server (POST /generate) and the trajectory API.

Both outlive restarts of the other side. The trainer restarts vLLM in weight-bridge mode `none`
(connections are refused or answered 5xx for a minute or more), and the API may restart too, so a
transient failure (connection error, timeout, 5xx, aborted generation) is retried with capped
exponential backoff, forever, keeping the request as it was. Raised at once instead, with the
server's answer, since retrying cannot fix them: a 4xx (a bug or a configuration error), and a
/generate that failed inside vLLM's engine while the server stays up (its 500 marked
``X-Onecopy-Error: engine``, e.g. a package vLLM needs for structured outputs is missing).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, Optional, TypeVar

import httpx
from pydantic import ValidationError

from environments.schemas import GenerateResponse, ScoredDataGroup

logger = logging.getLogger("onecopy.env")
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Waits between retries: initial, initial*factor, ... capped at maximum (seconds)."""

    initial: float = 2.0
    factor: float = 2.0
    # A restarted server is found within 2 s of its start (with 10 the environment waited up to 8 s
    # more after each vLLM (re)start, a request to a server that is down costing nothing).
    maximum: float = 2.0

    def delays(self) -> Iterator[float]:
        """Yield the successive waits, forever."""
        delay = self.initial
        while True:
            yield delay
            delay = min(delay * self.factor, self.maximum)


def inference_headers() -> dict[str, str]:
    """The bearer header for the inference server: ``$VLLM_API_KEY`` (the variable vLLM reads for
    its --api-key), else none. Read from the environment only, so the key is on no command line."""
    key = os.environ.get("VLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class Unavailable(Exception):
    """A transient failure: the other side is down, restarting or overloaded. Retried."""


class RequestFailed(RuntimeError):
    """The server answered, and the same request would fail again: raised at once, not retried."""


class RequestRejected(RequestFailed):
    """The server answered 4xx: the request itself is wrong."""


class EngineFailed(RequestFailed):
    """onecopy's vLLM server is up, and its engine failed the request with an unexpected error."""


# Set by onecopy's POST /generate on the 500 of a request its running engine failed
# (vllm_patching.generate_route.ENGINE_ERROR_HEADER; this side does not import vLLM's).
ENGINE_ERROR_HEADER = "X-Onecopy-Error"


def checked_json(resp: httpx.Response, hint: str = "") -> Any:
    """Return the JSON body of a 2xx answer; raise EngineFailed for a 500 marked as the engine's,
    Unavailable for any other 5xx, RequestRejected for 4xx."""
    if resp.headers.get(ENGINE_ERROR_HEADER) == "engine":
        raise EngineFailed(
            f"{resp.request.method} {resp.request.url} failed inside vLLM's engine, and would again "
            f"(HTTP {resp.status_code}): {error_message(resp)}; the vLLM server's log has the traceback "
            "(vllm.log in the trainer's --output-dir when the trainer started vLLM)"
        )
    if resp.status_code >= 500:
        raise Unavailable(f"HTTP {resp.status_code}: {resp.text[:200]}")
    if resp.status_code >= 400:
        raise RequestRejected(
            f"{resp.request.method} {resp.request.url} answered HTTP {resp.status_code}: "
            f"{resp.text[:500]}{hint}"
        )
    return resp.json()


def error_message(resp: httpx.Response) -> str:
    """The message of vLLM's error body (``{"error": {"message": ...}}``), else the body's text."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:500]


TRANSIENT = (Unavailable, httpx.TransportError)  # failures worth waiting out


class Retries:
    """The waits of one request retried after transient failures.

    The first failure, and then one every ``LOG_EVERY_SECONDS`` since the first (the attempts'
    own time counted: one may wait for a timeout), logs
    `[env] <what> unavailable, retrying in <s>s (...)`, a line people grep for.
    """

    LOG_EVERY_SECONDS = 10.0
    clock = staticmethod(time.monotonic)

    def __init__(self, what: str, backoff: Backoff):
        self.what = what
        self._delays = backoff.delays()
        self._first: Optional[float] = None  # the clock at the first failure
        self._logged: Optional[float] = None  # and at the last one logged

    def next_wait(self, exc: Exception) -> float:
        """Log the failure `exc` (see the class) and return how long to sleep before the next attempt."""
        delay = next(self._delays)
        now = self.clock()
        self._first = now if self._first is None else self._first
        if self._logged is None or now - self._logged >= self.LOG_EVERY_SECONDS:
            self._logged = now
            logger.warning(
                "[env] %s unavailable, retrying in %.1fs (%s; %.0fs waited so far)",
                self.what,
                delay,
                str(exc) or type(exc).__name__,
                now - self._first,
            )
        return delay


async def with_retry(what: str, attempt: Callable[[], Awaitable[T]], backoff: Backoff) -> T:
    """Run `attempt` until it does not raise Unavailable/httpx.TransportError, sleeping between."""
    retries = Retries(what, backoff)
    while True:
        try:
            return await attempt()
        except TRANSIENT as exc:
            await asyncio.sleep(retries.next_wait(exc))


class InferenceClient:
    """Client of the inference server's POST /generate (onecopy's vLLM server)."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        max_requests_at_once: int,
        backoff: Backoff,
        model: Optional[str] = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.backoff = backoff
        self.model = model
        self._http = httpx.AsyncClient(timeout=timeout, headers=inference_headers())
        # Bounds requests open at once (training groups and eval share it).
        self._slots = asyncio.Semaphore(max_requests_at_once)

    async def generate(
        self,
        prompt_token_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: Optional[list[str]] = None,
        seed: Optional[int] = None,
        **sampling_params: Any,
    ) -> GenerateResponse:
        """Sample `n` completions of one tokenised prompt; waits out server restarts.

        `sampling_params`: any other of vLLM's SamplingParams fields, sent as they are (the server
        refuses unknown ones), e.g. `structured_outputs={"regex": ...}` to constrain a turn."""
        body = {**sampling_params,
            "prompt_token_ids": prompt_token_ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop": stop,
            "seed": seed,
        }
        if self.model:  # only when set: the base contract has no `model` field
            body["model"] = self.model

        async def attempt() -> GenerateResponse:
            async with self._slots:
                resp = await self._http.post(f"{self.base_url}/generate", json=body)
            hint = (" (set $VLLM_API_KEY to the vLLM server's key)" if resp.status_code == 401 else
                    " (is --openai.base_url onecopy's vLLM server with POST /generate?)")
            data = checked_json(resp, hint=hint)
            try:
                out = GenerateResponse.model_validate(data)
            except ValidationError as exc:
                raise RuntimeError(f"/generate answered an unexpected body: {exc}") from exc
            if len(out.choices) != n:
                raise RuntimeError(f"/generate returned {len(out.choices)} choices, asked for n={n}")
            # vLLM aborts requests that are in flight when the trainer pauses it for a weight
            # update; their tokens are cut short, so sample the whole group again.
            if any(c.finish_reason == "abort" for c in out.choices):
                raise Unavailable("generation aborted by the server")
            return out

        return await with_retry("inference server", attempt, self.backoff)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()


class TrajectoryApiClient:
    """Client of the trajectory API (Atropos-compatible paths and fields)."""

    def __init__(self, base_url: str, api_key: Optional[str], backoff: Backoff, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.backoff = backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(timeout=timeout, headers=headers)

    async def _call(self, method: str, path: str, json: Any = None) -> Any:
        async def attempt() -> Any:
            resp = await self._http.request(method, f"{self.base_url}{path}", json=json)
            hint = " (check --env.api_key / $ONECOPY_API_KEY)" if resp.status_code in (401, 403) else ""
            return checked_json(resp, hint)

        return await with_retry("trajectory API", attempt, self.backoff)

    async def register_env(self, body: dict[str, Any], poll_s: float) -> dict[str, Any]:
        """POST /register-env until the trainer is registered; return the success answer."""
        asked = 0
        while True:
            data = await self._call("POST", "/register-env", body)
            status = data.get("status")
            if status == "success":
                return data
            if status and "wait" in status:
                # Once at INFO: the trainer may take minutes to load the model.
                level = logging.INFO if asked == 0 else logging.DEBUG
                logger.log(level, "[env] API says %r; asking again every %.1fs", status, poll_s)
                asked += 1
                await asyncio.sleep(poll_s)
                continue
            raise RuntimeError(f"/register-env answered {data!r}; expected status 'success'")

    async def info(self) -> dict[str, Any]:
        """GET /info: the trainer's batch_size and max_token_len (-1 while unknown)."""
        return await self._call("GET", "/info")

    async def status(self) -> dict[str, Any]:
        """GET /status: current_step (trainer) and queue_size (groups waiting); onecopy's API adds
        queued_sequences (their rows) and batch_ready (whether a batch adds up from them)."""
        return await self._call("GET", "/status")

    async def report_dropped(self, env_id: int, counts: dict[str, int]) -> None:
        """POST /env-dropped: this environment's totals of dropped groups, by reason."""
        await self._call("POST", "/env-dropped", {"env_id": env_id, "counts": counts})

    async def post_scored_data(self, group: ScoredDataGroup) -> str:
        """POST /scored_data, retrying with the same group_uuid until the API answers 2xx.

        Returns the API's status ('received', or 'duplicate' when an earlier attempt had landed).
        """
        body = group.model_dump(mode="json")
        data = await self._call("POST", "/scored_data", body)
        status = str(data.get("status", ""))
        if status == "duplicate":
            logger.info("[env] API already had group %s (an earlier attempt landed)", group.group_uuid)
        return status

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()
