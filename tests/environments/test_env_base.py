"""BaseEnv against fake inference and API servers: group layout, retries, filtering, process."""

import asyncio
import base64
import importlib
import itertools
import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
from env_fakes import FakeApi, FakeInference, FakeServer, on_first_log, one_group

from environments.clients import RequestRejected
from environments.schemas import ScoredDataGroup

pytestmark = pytest.mark.timeout(60)


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


_one_group = one_group


def test_group_has_aligned_tokens_masks_and_logprobs(make_env, fake_inference, tokenizer):
    fake_inference.texts = ["yes", "no thanks", "no", "yes"]
    env = make_env(fake_inference.server.url)
    group, backlog = run(_one_group(env))

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q1"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    request = fake_inference.requests[0]
    assert request["prompt_token_ids"] == prompt
    assert request["n"] == 4 and request["max_tokens"] == 16 and request["temperature"] == 1.0
    assert "model" not in request  # not part of the base /generate contract unless asked for
    assert backlog == []
    assert group.scores == [1.0, 0.0, 0.0, 1.0]
    for text, tokens, masks, logprobs, chat in zip(
        fake_inference.texts, group.tokens, group.masks, group.inference_logprobs, group.messages, strict=True
    ):
        completion = tokenizer.encode(text, add_special_tokens=False)
        assert tokens == prompt + completion
        assert masks == [-100] * len(prompt) + completion
        assert logprobs == [1.0] * len(prompt) + [-0.5] * len(completion)
        assert chat[-1] == {"role": "assistant", "content": text}


def test_routed_experts_pass_from_generate_to_the_group_as_the_api_takes_them(make_env, fake_inference):
    from api.models import ScoredData
    from api.validation import check_shape

    fake_inference.routes = True
    group, _ = run(_one_group(make_env(fake_inference.server.url)))
    assert [r.data for r in group.routed_experts] == [
        base64.b64encode(bytes([i]) * (len(tokens) - 1)).decode() for i, tokens in enumerate(group.tokens)]
    check_shape(ScoredData.model_validate(group.model_dump(mode="json")))  # one position per token but the last
    fake_inference.routes = False
    assert run(_one_group(make_env(fake_inference.server.url)))[0].routed_experts is None


def test_model_name_is_sent_as_the_adapter_to_serve(make_env, fake_inference):
    run(_one_group(make_env(fake_inference.server.url, server_kw={"model_name": "adapter-v3"})))
    assert fake_inference.requests[0]["model"] == "adapter-v3"


def test_completion_budget_is_cut_to_fit_max_token_length(make_env, fake_inference, tokenizer):
    env = make_env(fake_inference.server.url, max_token_length=40, max_tokens=30)
    run(_one_group(env))
    prompt_len = len(fake_inference.requests[0]["prompt_token_ids"])
    assert fake_inference.requests[0]["max_tokens"] == 40 - prompt_len


def test_prompt_longer_than_max_token_length_is_skipped_without_generating(make_env, fake_inference, caplog):
    env = make_env(fake_inference.server.url, max_token_length=10, max_tokens=5)
    with caplog.at_level(logging.INFO, logger="onecopy.env"):
        group, _ = run(_one_group(env))
    assert group is None and fake_inference.requests == []
    assert env.counts["skipped_too_long"] == 1
    assert "skipped group: prompt has" in caplog.text


def test_all_equal_scores_are_dropped_and_logged(make_env, fake_inference, tmp_path, caplog):
    fake_inference.texts = ["no"]
    out = tmp_path / "groups.jsonl"
    env = make_env(fake_inference.server.url, data_path_to_save_groups=str(out), total_steps=1)

    async def go():
        env.open_clients()
        await env.setup()
        group, _ = await env.collect_trajectories(await env.get_next_item())
        kept = await env.handle_send_to_api(group, do_send_to_api=False)
        await env.close_clients()
        return kept

    with caplog.at_level(logging.INFO, logger="onecopy.env"):
        assert run(go()) is False
    assert env.counts["dropped_equal_scores"] == 1 and env.groups_sent == 0
    assert "dropped group: all 4 scores equal 0.0" in caplog.text
    assert out.read_text() == ""


def test_serve_posts_groups_with_env_id(make_env, fake_inference, fake_api):
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=3)
    run(env.env_manager())
    assert len(fake_api.groups) == 3
    assert fake_api.registrations[0] == {
        "max_token_length": 128,
        "desired_name": "echo",
        "weight": 1.0,
        "group_size": 4,
    }
    for body in fake_api.groups.values():
        ScoredDataGroup.model_validate(body)
        assert body["env_id"] == 0 and len(body["tokens"]) == 4


def test_total_steps_is_exact_with_concurrent_workers(make_env, fake_inference, fake_api):
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=5, max_num_workers=3)
    run(env.env_manager())
    assert len(fake_api.groups) == 5 and env.groups_sent == 5


def test_register_waits_for_the_trainer(make_env, fake_inference, fake_api, caplog):
    fake_api.wait_registrations = 2
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)
    with caplog.at_level(logging.INFO, logger="onecopy.env"):
        run(env.env_manager())
    assert len(fake_api.registrations) == 3 and len(fake_api.groups) == 1
    assert "wait for trainer to start" in caplog.text


def test_register_asks_at_its_own_interval_not_the_status_polls(make_env, fake_inference, fake_api):
    # The trainer registers after vLLM is up; an environment that asked every status poll (2 s)
    # started the first batch up to 2 s late. Two waits of a 5 s status poll would take 10 s.
    fake_api.wait_registrations = 2
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)
    env.status_poll_s, env.register_poll_s = 5.0, 0.05
    started = time.monotonic()
    run(env.env_manager())
    assert len(fake_api.registrations) == 3 and len(fake_api.groups) == 1
    assert time.monotonic() - started < 4.0


def test_api_errors_then_ok_posts_the_group_exactly_once(make_env, fake_inference, fake_api, caplog):
    # First attempt lands but its answer is lost (500); the second meets a 503; the third is
    # answered 'duplicate'. The API must hold one group, and every attempt must carry one uuid.
    fake_api.lose_next_answers, fake_api.fail_next_posts = 1, 0
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)

    original = fake_api.__call__

    def second_attempt_busy(method, path, body, headers):
        if path == "/scored_data" and len(fake_api.post_uuids) == 1:
            fake_api.fail_next_posts = 1
        return original(method, path, body, headers)

    fake_api.server.app = second_attempt_busy
    fake_api.server.stop()
    fake_api.server.start()
    with caplog.at_level(logging.INFO, logger="onecopy.env"):
        run(env.env_manager())
    assert len(fake_api.post_uuids) == 3 and len(set(fake_api.post_uuids)) == 1
    assert list(fake_api.groups) == fake_api.post_uuids[:1]
    assert "trajectory API unavailable, retrying in" in caplog.text
    assert "API already had group" in caplog.text


def test_api_down_then_up_posts_the_group_once(make_env, tokenizer, fake_api, caplog):
    # The API goes away while the first group is being generated, and comes back once the
    # environment has logged it down (not after a fixed delay, which a loaded machine may overrun).
    inference = FakeInference(tokenizer)
    drop_once = threading.Lock()  # only the first request (of either worker) takes it

    def generate_then_drop_api(method, path, body, headers):
        if drop_once.acquire(blocking=False):
            fake_api.server.stop()  # down before this answer reaches the environment
        return inference(method, path, body, headers)

    server = FakeServer(generate_then_drop_api).start()
    try:
        env = make_env(server.url, fake_api.server.url, total_steps=1)
        with caplog.at_level(logging.WARNING, logger="onecopy.env"):
            with on_first_log("trajectory API unavailable", fake_api.server.start):
                run(env.env_manager())
    finally:
        server.stop()
    assert len(fake_api.groups) == 1 and len(set(fake_api.post_uuids)) == 1
    assert "trajectory API unavailable, retrying in" in caplog.text


def test_inference_down_then_up_waits_and_continues(make_env, tokenizer, fake_api, caplog):
    inference = FakeInference(tokenizer)
    server = FakeServer(inference)  # not listening yet: connections are refused
    try:
        env = make_env(server.url, fake_api.server.url, total_steps=2)
        with caplog.at_level(logging.WARNING, logger="onecopy.env"):
            # Up once the environment has logged it down: a fixed delay (0.6 s) raced the
            # environment's start on a loaded machine, which then never saw the server down.
            with on_first_log("inference server unavailable", server.start):
                run(env.env_manager())
    finally:
        server.stop()
    assert len(fake_api.groups) == 2
    assert "[env] inference server unavailable, retrying in " in caplog.text


def test_inference_5xx_and_aborted_generations_are_retried(make_env, fake_inference, fake_api):
    fake_inference.fail_next = 2
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1, max_num_workers=1)
    original = fake_inference.__call__
    aborted = []

    def abort_once(method, path, body, headers):
        code, payload = original(method, path, body, headers)
        if code == 200 and not aborted:
            aborted.append(True)
            payload["choices"][0]["finish_reason"] = "abort"
        return code, payload

    fake_inference.server.app = abort_once
    fake_inference.server.stop()
    fake_inference.server.start()
    run(env.env_manager())
    assert len(fake_api.groups) == 1 and len(fake_inference.requests) == 2


def test_serve_stops_when_the_trainer_reaches_num_steps(make_env, fake_inference, fake_api):
    fake_api.num_steps, fake_api.current_step = 3, 3
    env = make_env(fake_inference.server.url, fake_api.server.url)  # no total_steps: until the trainer ends
    run(env.env_manager())
    assert env.curr_step == 3


def test_serve_evaluates_every_steps_per_eval(make_env, fake_inference, fake_api, caplog):
    fake_api.num_steps = 2  # the run ends when the trainer reaches step 2
    env = make_env(fake_inference.server.url, fake_api.server.url, steps_per_eval=1)
    env.eval_items = [{"question": "q-eval"}]  # the fake answers 'yes' to the first choice: score 1
    # Step 1 comes after the environment's first read of the trainer's step, however long its start
    # takes (a loaded machine's: set after a fixed 0.3 s, the first read saw step 1 already and the
    # environment never saw it begin, so it never evaluated).
    fake_api.step_at_read = {2: 1}
    setup = env.setup

    async def slow_setup():
        await asyncio.sleep(0.5)  # as slow as that machine's
        await setup()

    env.setup = slow_setup
    # Step 2 ends the run and cancels an evaluation in flight, so it comes once the step-1
    # evaluation has logged its result (after a fixed 0.8 s, a loaded machine lost the eval).
    step_2 = lambda: setattr(fake_api, "current_step", 2)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="onecopy.env"):
        with on_first_log("[env] eval accuracy=", step_2):
            run(env.env_manager())
    assert "[env] eval accuracy=1.000 over 1 items at step 1" in caplog.text
    eval_requests = [r for r in fake_inference.requests if r["n"] == 1]
    assert eval_requests and eval_requests[0]["temperature"] == 0.0


def test_back_pressure_waits_for_the_queue_to_drain(make_env, fake_inference, fake_api):
    fake_api.batch_size, fake_api.queue_size = 4, 3  # 3 groups of 4 >= 3 batches of 4: full
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)
    threading.Timer(0.5, lambda: setattr(fake_api, "queue_size", 0)).start()
    run(env.env_manager())
    assert len(fake_api.groups) == 1 and env.batch_size == 4


def test_back_pressure_counts_groups_in_flight(make_env, fake_inference, fake_api):
    # A bound of one group (1 batch of 4 sequences, groups of 4): four workers must still
    # generate one group at a time; counting only the queue let all four run at once.
    fake_api.batch_size = 4
    fake_inference.delay_s = 0.2
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=4, max_num_workers=4,
                   max_batches_offpolicy=1)
    run(env.env_manager())
    assert len(fake_api.groups) == 4 and fake_inference.most_open == 1


def test_back_pressure_counts_a_posted_group_before_the_api_says_so(make_env, fake_inference, fake_api):
    # The API's queue grows with each post and a fake trainer empties it every 0.25 s. A group
    # that has just been posted leaves the in-flight count before a status read shows it queued:
    # counted nowhere, it let the next group start while the bound (one group) was full.
    fake_api.batch_size, fake_api.queue_grows = 4, True
    fake_inference.delay_s = 0.05
    seen = []  # queued + generating, as each /generate starts
    fake_inference.on_request = lambda: seen.append(fake_api.queue_size + fake_inference.open)
    stop = threading.Event()

    def trainer():
        while not stop.wait(0.25):
            fake_api.queue_size = 0

    threading.Thread(target=trainer, daemon=True).start()
    # One worker: with more, a waiting one holds the queue check and reads the API meanwhile.
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=4, max_num_workers=1,
                   max_batches_offpolicy=1)
    try:
        run(env.env_manager())
    finally:
        stop.set()
    assert len(fake_api.groups) == 4 and max(seen) == 1


STATUS_POLL_SECONDS = 60.0  # the test below: a step poll far slower than a worker's own queue reads


def test_back_pressure_resumes_as_soon_as_the_trainer_takes_a_batch(make_env, fake_inference, fake_api):
    # The trainer's step poll is slow here (60 s); a waiting worker asks for the queue itself, so
    # the group goes out well before the next step poll would have told it there is room.
    fake_api.batch_size, fake_api.queue_size = 4, 3
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)
    env.status_poll_s = STATUS_POLL_SECONDS
    drained_at = []
    threading.Timer(0.3, lambda: (setattr(fake_api, "queue_size", 0), drained_at.append(time.monotonic()))).start()
    run(env.env_manager())
    assert len(fake_api.groups) == 1
    # Within half the step poll it would otherwise wait for: the worker's own queue reads come every
    # 0.05 s, so a loaded machine has 30 s of room (4 s against a 5 s poll left it 1).
    assert time.monotonic() - drained_at[0] < STATUS_POLL_SECONDS / 2


class ApiWithQueueAtStart(FakeApi):
    """The API of a run whose queue already holds 3 groups of 4 rows when this environment starts
    (another environment's, or its own before a restart); the trainer takes them once the
    environment has read the status. `events` logs /status reads and posts in order."""

    def __init__(self, events):
        super().__init__(batch_size=4)
        self.events, self.queue_size = events, 3

    def __call__(self, method, path, body, headers):
        answer = super().__call__(method, path, body, headers)
        if path in ("/status", "/scored_data"):
            self.events.append(path)
        if path == "/status":
            self.queue_size = 0
        return answer


def test_back_pressure_reads_the_queue_before_the_first_group(make_env, fake_inference):
    # A bound of 4 batches of 4 rows, 12 of them queued before this environment starts. Taking the
    # queue for empty until its first status read, each of 4 workers started a group (16 rows in
    # flight beside the 12): 28 rows against a bound of 16.
    events = []
    api = ApiWithQueueAtStart(events)
    server = FakeServer(api).start()
    fake_inference.on_request = lambda: events.append("/generate")
    env = make_env(fake_inference.server.url, server.url, total_steps=4, max_num_workers=4,
                   max_batches_offpolicy=4)
    env.status_poll_s = 5.0  # the status poller reads late: what counts is what the workers read
    try:
        run(env.env_manager())
    finally:
        server.stop()
    assert len(api.groups) == 4
    before_first_read = events[: events.index("/status") if "/status" in events else len(events)]
    assert (before_first_read.count("/generate"), before_first_read.count("/scored_data")) == (0, 0)


def post_rows(env, rows):
    """Make `env` post groups of rows[0], rows[1], ... rows, the rest of each group left out, as
    the episodes that went unscored leave a multi-turn group."""
    sizes = iter(rows)
    collect = env.collect_trajectories

    async def shortened(item):
        group, backlog = await collect(item)
        n = next(sizes)
        fields = ("tokens", "masks", "scores", "inference_logprobs", "messages")
        return group.model_copy(update={f: getattr(group, f)[:n] for f in fields}), backlog

    env.collect_trajectories = shortened


def test_back_pressure_counts_rows_so_short_groups_still_fill_a_batch(make_env, fake_inference, fake_api):
    # Groups of 2 rows where group_size is 4, and a bound of one batch of 4 rows. Counted as 4 rows
    # each, the first group queued filled the bound: the environment waited for the trainer, the
    # trainer waited for 2 more rows, and the run never ended (run()'s 30 s deadline failed it).
    fake_api.batch_size, fake_api.num_steps, fake_api.trainer_takes_batches = 4, 2, True
    env = make_env(fake_inference.server.url, fake_api.server.url, max_batches_offpolicy=1,
                   ensure_scores_are_not_same=False)
    post_rows(env, itertools.repeat(2))
    run(env.env_manager())
    assert fake_api.current_step == 2 and fake_api.rows_served == 8


def test_back_pressure_never_holds_a_queue_that_cannot_make_a_batch(make_env, fake_inference, fake_api):
    # Groups of 3, 3, 1, 1 rows against batches of 4: the two groups of 3 hold 6 rows, over the
    # bound of 4, yet no batch adds up to exactly 4 of them. The API says no batch is ready, so the
    # environment generates one more group (the 1 that completes 3 + 1) instead of waiting forever.
    fake_api.batch_size, fake_api.num_steps, fake_api.trainer_takes_batches = 4, 2, True
    env = make_env(fake_inference.server.url, fake_api.server.url, max_batches_offpolicy=1, max_num_workers=1,
                   ensure_scores_are_not_same=False)
    post_rows(env, itertools.chain([3, 3, 1, 1], itertools.repeat(1)))  # 1s after: groups the run may start as it ends
    run(env.env_manager())
    assert fake_api.current_step == 2 and fake_api.rows_served == 8


def test_bearer_token_is_sent_when_configured(make_env, fake_inference, fake_api, monkeypatch):
    monkeypatch.setenv("ONECOPY_API_KEY", "from-env")
    run(make_env(fake_inference.server.url, fake_api.server.url, total_steps=1).env_manager())
    assert {h.get("Authorization") for h in fake_api.headers} == {"Bearer from-env"}
    fake_api.headers.clear()
    run(make_env(fake_inference.server.url, fake_api.server.url, total_steps=1, api_key="flag").env_manager())
    assert {h.get("Authorization") for h in fake_api.headers} == {"Bearer flag"}


def test_api_4xx_fails_loudly(make_env, fake_inference, fake_api):
    fake_api.server.app = lambda method, path, body, headers: (401, {"detail": "bad token"})
    fake_api.server.stop()
    fake_api.server.start()
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)
    with pytest.raises(RequestRejected, match="401.*ONECOPY_API_KEY"):
        run(env.env_manager())


def test_process_writes_jsonl_without_the_api(make_env, fake_inference, tmp_path):
    out = tmp_path / "sub" / "groups.jsonl"
    env = make_env(fake_inference.server.url, total_steps=3, data_path_to_save_groups=str(out))
    run(env.process_manager())
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and len({line["group_uuid"] for line in lines}) == 3
    for line in lines:
        ScoredDataGroup.model_validate(line)
        assert line["env_id"] is None and line["scores"] == [1.0, 0.0, 1.0, 0.0]
    again = make_env(fake_inference.server.url, total_steps=1, data_path_to_save_groups=str(out))
    with pytest.raises(FileExistsError, match="pass a new path"):
        run(again.process_manager())


def test_wandb_log_reports_env_metrics(make_env, fake_inference, tmp_path):
    env = make_env(
        fake_inference.server.url, total_steps=2, data_path_to_save_groups=str(tmp_path / "g.jsonl")
    )
    run(env.process_manager())
    env._scores, env._completion_lengths = [1.0, 0.0], [3, 2]
    metrics = run(env.wandb_log({"env/custom": 1.0}))
    assert metrics["env/score_mean"] == 0.5 and metrics["env/completion_len_mean"] == 2.5
    assert metrics["env/groups_sent"] == 2 and metrics["env/custom"] == 1.0
    assert metrics["env/groups_dropped_equal_scores"] == 0


def test_scored_data_group_rejects_misaligned_rows():
    with pytest.raises(ValueError, match="masks\\[0\\] has 2 entries"):
        ScoredDataGroup(tokens=[[1, 2, 3]], masks=[[-100, 2]], scores=[1.0])
    with pytest.raises(ValueError, match="one row per sequence"):
        ScoredDataGroup(tokens=[[1]], masks=[[1]], scores=[1.0, 0.0])


def test_a_server_back_up_is_found_within_2_s_and_the_wait_is_logged_every_10_s(monkeypatch, caplog):
    """The default backoff: a vLLM that is down for 6.5 s (a restart) is asked again within 2 s of
    coming back (the 10 s cap found it at 14 s), and the wait is not logged at every retry."""
    import asyncio

    from environments import clients

    clock = {"now": 0.0}

    async def fake_sleep(seconds):
        clock["now"] += seconds

    async def attempt():
        if clock["now"] < 6.5:
            raise clients.Unavailable("down")
        return "up"

    monkeypatch.setattr(clients.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(clients.Retries, "clock", staticmethod(lambda: clock["now"]))
    with caplog.at_level("WARNING"):
        assert asyncio.run(clients.with_retry("inference server", attempt, clients.Backoff())) == "up"
    assert 6.5 <= clock["now"] <= 8.5
    assert caplog.text.count("inference server unavailable, retrying in") == 1

    clock["now"] = 0.0  # down for 30 s, each attempt taking 1 s: logged after 0, 12 and 24 s
    caplog.clear()

    async def long_attempt():
        clock["now"] += 1.0
        if clock["now"] < 30:
            raise clients.Unavailable("down")
        return "up"

    with caplog.at_level("WARNING"):
        asyncio.run(clients.with_retry("inference server", long_attempt, clients.Backoff()))
    assert caplog.text.count("inference server unavailable, retrying in") == 3


def _drop_one_group(env):
    async def go():
        env.open_clients(post_to_api=True)
        await env.setup()
        env.env_id = 0  # as registration sets it
        group, _ = await env.collect_trajectories(await env.get_next_item())
        kept = await env.handle_send_to_api(group)
        await env.close_clients()
        return kept

    return run(go())


def test_an_environment_that_drops_a_group_tells_the_api_its_totals(make_env, fake_inference, fake_api):
    """A trainer waiting for a batch reads them in GET /status and says why no batch comes."""
    fake_inference.texts = ["no"]  # every completion scores 0.0: the group is dropped
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)
    assert _drop_one_group(env) is False
    assert fake_api.drop_reports == [{"env_id": 0, "counts": {"dropped_equal_scores": 1, "skipped_too_long": 0,
                                                              "skipped_bad_values": 0}}]


def test_an_api_without_the_drop_report_route_is_asked_once_and_the_group_flow_goes_on(make_env, fake_inference,
                                                                                     fake_api, caplog):
    fake_inference.texts = ["no"]
    fake_api.take_drop_reports = False  # Atropos's own API
    env = make_env(fake_inference.server.url, fake_api.server.url, total_steps=1)
    with caplog.at_level(logging.INFO, logger="onecopy.env"):
        assert _drop_one_group(env) is False
    assert "the API took no drop counts" in caplog.text and env._dropped_reported_at is None


def test_generate_sends_other_sampling_params_as_given(fake_inference):
    from env_fakes import FAST

    from environments.clients import InferenceClient

    async def go():
        client = InferenceClient(fake_inference.server.url, 5.0, 4, FAST)
        try:
            await client.generate([1, 2], n=1, max_tokens=4, temperature=1.0,
                                  structured_outputs={"regex": "a+"}, min_tokens=2)
        finally:
            await client.aclose()

    run(go())
    (body,) = fake_inference.requests
    assert body["structured_outputs"] == {"regex": "a+"} and body["min_tokens"] == 2
    assert body["prompt_token_ids"] == [1, 2] and body["max_tokens"] == 4


@pytest.mark.parametrize("module, requirements", [("environments.reasoning_gym_server", "requirements-reasoning-gym.txt"),
                                                  ("environments.verifiers_server", "requirements-verifiers.txt")])
def test_an_extras_missing_package_error_gives_the_install_command_of_its_requirements_file(module, requirements):
    # The command a user is told when the package is missing is the one the file's header gives: a
    # plain `pip install -r` of the reasoning-gym file cannot resolve (it pins tabulate 0.10.0,
    # reasoning-gym asks for 0.9.0).
    header = (Path(__file__).resolve().parents[2] / requirements).read_text()
    command = re.search(r"Install with\n#\s+(pip install .*)\n", header).group(1)
    assert command in importlib.import_module(module).INSTALL_HINT
