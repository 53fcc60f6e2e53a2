"""Fakes for environment tests: a tiny local tokenizer and fake HTTP servers in threads.

FakeInference answers POST /generate like onecopy's vLLM server; FakeApi answers the trajectory
API's register-env / info / status / scored_data. Both can be told to fail the next requests,
and FakeServer can be stopped and started again on the same port to play a restart.
(A module with its own name, not conftest: other test folders have conftests too.)
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from api.batching import pick_exact
from environments.clients import Backoff
from example_trainer.engine.ports import free_port

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAST = Backoff(initial=0.05, factor=2.0, maximum=0.2)


async def one_group(env):
    """(group, backlog) of one item of `env`, with its clients opened and closed around it."""
    env.open_clients()
    try:
        await env.setup()
        return await env.collect_trajectories(await env.get_next_item())
    finally:
        await env.close_clients()


def build_tokenizer(folder) -> str:
    """Save a byte-level tokenizer (one token per byte, chat template) to `folder`; no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return str(folder)


@contextlib.contextmanager
def on_first_log(text: str, action: Callable[[], None], logger_name: str = "onecopy.env") -> Iterator[None]:
    """Run `action` once, in the logging thread, when a record containing `text` is first logged.

    Tests bring a server up right after the environment has logged it down, rather than after a
    fixed delay: on a loaded machine the environment may not reach the server within the delay,
    and would then never see it down.
    """
    fired = threading.Event()

    class Trigger(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not fired.is_set() and text in record.getMessage():
                fired.set()
                action()

    trigger = Trigger()
    log = logging.getLogger(logger_name)
    log.addHandler(trigger)
    try:
        yield
    finally:
        log.removeHandler(trigger)


def model_card(name: str, root: str, parent: str | None = None) -> dict:
    """One entry of vLLM's GET /v1/models (its ModelCard fields)."""
    return {"id": name, "object": "model", "owned_by": "vllm", "root": root, "parent": parent, "permission": []}


class FakeServer:
    """A JSON-over-HTTP server in a thread; `app(method, path, body, headers) -> (code, json)`, or
    `(code, json, headers)` to send headers of its own."""

    def __init__(self, app: Callable[..., tuple[int, Any]], port: int | None = None):
        self.app, self.port, self._httpd = app, port or free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeServer":
        app = self.app

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                code, payload, *extra = app(self.command, self.path, body, dict(self.headers))
                data = json.dumps(payload).encode()
                self.send_response(code)
                for name, value in (extra[0] if extra else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

            def log_message(self, *args):  # keep test output quiet
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()


class FakeInference:
    """POST /generate: answers `texts` in turn as completions, each token with logprob -0.5.

    `answer_arithmetic=True` reads "What is A op B?" from the decoded prompt and makes even
    choices right and odd choices wrong, so groups always have mixed scores.
    GET /v1/models answers `models` as vLLM does: the base model, whose `root` is the folder it
    was loaded from (the tokenizer's folder unless a test says otherwise), then LoRA adapters.
    """

    def __init__(self, tokenizer, texts=("yes", "no"), answer_arithmetic=False):
        self.tokenizer, self.texts, self.answer_arithmetic = tokenizer, list(texts), answer_arithmetic
        self.fail_next = 0  # answer this many requests with 503
        self.routes = False  # True: each choice carries routed_experts, as a server run with --enable-return-routed-experts
        self.requests: list[dict] = []
        self.models = [model_card("base", tokenizer.name_or_path)]
        self.delay_s = 0.0  # seconds each /generate takes
        self.open, self.most_open = 0, 0  # /generate requests being answered now, and the most at once
        self.on_request: Callable[[], None] = lambda: None  # called as each /generate starts
        self._count = threading.Lock()

    def __call__(self, method, path, body, headers):
        if path == "/health":
            return 200, {}
        if (method, path) == ("GET", "/v1/models"):
            return 200, {"object": "list", "data": self.models}
        assert (method, path) == ("POST", "/generate"), (method, path)
        if self.fail_next > 0:
            self.fail_next -= 1
            return 503, {"error": "restarting"}
        self.requests.append(body)
        with self._count:
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            self.on_request()
        time.sleep(self.delay_s)
        with self._count:
            self.open -= 1
        choices = []
        for i in range(body["n"]):
            text = self._text(body["prompt_token_ids"], i)
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: body["max_tokens"]]
            choices.append(
                {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop", "text": text}
            )
            if self.routes:  # one layer, one expert per token: expert i for every position of choice i
                positions = len(body["prompt_token_ids"]) + len(ids) - 1
                choices[-1]["routed_experts"] = {"layers": 1, "top_k": 1, "dtype": "uint8",
                                                 "data": base64.b64encode(bytes([i]) * positions).decode()}
        return 200, {"prompt_token_ids": body["prompt_token_ids"], "choices": choices}

    def _text(self, prompt_ids, i) -> str:
        if not self.answer_arithmetic:
            return self.texts[i % len(self.texts)]
        a, op, b = re.findall(r"What is (\d+) ([-+*]) (\d+)\?", self.tokenizer.decode(prompt_ids))[-1]
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        return f"The answer is \\boxed{{{value if i % 2 == 0 else value + 1}}}"


class FakeApi:
    """The trajectory API: stores groups by group_uuid, answers 'duplicate' for a known one.

    `trainer_takes_batches=True` keeps the queue as the real API does (rows per queued group, in
    order), answers /status with its rows and whether a batch is ready, and plays a trainer that
    takes a batch of exactly batch_size rows (the API's own pick) the moment the queue holds one,
    counting a step, until num_steps: whether the environment keeps a batch coming is then a fact
    of the run.
    """

    def __init__(self, wait_registrations=0, batch_size=16, num_steps=100):
        self.wait_registrations = wait_registrations
        self.batch_size, self.num_steps = batch_size, num_steps
        self.fail_next_posts = 0  # 503 before storing
        self.lose_next_answers = 0  # store, then answer 500 (the answer is lost, the post landed)
        self.groups: dict[str, dict] = {}
        self.post_uuids: list[str] = []
        self.registrations: list[dict] = []
        self.headers: list[dict] = []
        self.current_step, self.queue_size = 0, 0
        self.step_at_read: dict[int, int] = {}  # the trainer's step from the Nth /status read on
        self.status_reads = 0
        self.queue_grows = False  # True: each stored group adds one to queue_size, as the real queue
        self.take_drop_reports = True  # False: answer POST /env-dropped 404, as Atropos's API does
        self.drop_reports: list[dict] = []
        self.trainer_takes_batches = False
        self.queue: list[int] = []  # rows of each queued group, oldest first (trainer_takes_batches)
        self.rows_served = 0
        self._queue_lock = threading.Lock()

    def __call__(self, method, path, body, headers):
        self.headers.append(headers)
        if path == "/register-env":
            self.registrations.append(body)
            if self.wait_registrations > 0:
                self.wait_registrations -= 1
                return 200, {"status": "wait for trainer to start"}
            return 200, {
                "status": "success",
                "env_id": 0,
                "wandb_name": "test-0",
                "starting_step": 0,
                "checkpoint_interval": -1,
                "num_steps": self.num_steps,
            }
        if path == "/info":
            return 200, {"batch_size": self.batch_size, "max_token_len": -1}
        if path == "/status":
            self.status_reads += 1
            self.current_step = self.step_at_read.get(self.status_reads, self.current_step)
        if path == "/status" and self.trainer_takes_batches:
            with self._queue_lock:
                return 200, {"current_step": self.current_step, "queue_size": len(self.queue),
                             "queued_sequences": sum(self.queue),
                             "batch_ready": pick_exact(self.queue, self.batch_size) is not None}
        if path == "/status":
            return 200, {"current_step": self.current_step, "queue_size": self.queue_size}
        if path == "/env-dropped" and self.take_drop_reports:
            self.drop_reports.append(body)
            return 200, {"status": "success"}
        if path == "/scored_data":
            self.post_uuids.append(body["group_uuid"])
            if self.fail_next_posts > 0:
                self.fail_next_posts -= 1
                return 503, {"detail": "busy"}
            if body["group_uuid"] in self.groups:
                return 200, {"status": "duplicate"}
            self.groups[body["group_uuid"]] = body
            self.queue_size += self.queue_grows
            if self.trainer_takes_batches:
                self._queue_and_train(len(body["tokens"]))
            if self.lose_next_answers > 0:
                self.lose_next_answers -= 1
                return 500, {"detail": "answer lost"}
            return 200, {"status": "received"}
        return 404, {"detail": f"no route {path}"}

    def _queue_and_train(self, rows: int) -> None:
        with self._queue_lock:
            self.queue.append(rows)
            picked = pick_exact(self.queue, self.batch_size)
            if picked is not None and self.current_step < self.num_steps:  # the trainer ends at num_steps
                self.queue = [size for i, size in enumerate(self.queue) if i not in picked]
                self.rows_served += self.batch_size
                self.current_step += 1
