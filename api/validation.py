"""Rules a scored group must follow before it is queued, beyond what its types already say.

Checked against the registered trainer's limits inside the same transaction that stores the
group, so a concurrent re-registration cannot slip a group past a limit it no longer meets.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.errors import GroupRejected
from api.models import ScoredData

# One entry per sequence. The optional ones may be null or [] (Atropos's BaseEnv sends [] when
# no sequence carries the field); when sent, each of their rows has one value per token, like masks:
# a short row would crash the trainer after the API had handed the group out.
DISTILL_PAIR = ("distill_token_ids", "distill_logprobs")
REQUIRED_PER_SEQUENCE = ("masks", "scores")
OPTIONAL_PER_SEQUENCE = ("advantages", "ref_logprobs", "inference_logprobs", "weight_versions", "routed_experts",
                         *DISTILL_PAIR)
PER_TOKEN = ("masks", "advantages", "ref_logprobs", "inference_logprobs", "weight_versions", *DISTILL_PAIR)
PER_TOKEN_ENTRY = {  # what one entry of a row is, for the error message; else "value per token"
    "masks": "mask entry per token (-100 for prompt tokens)",
    "weight_versions": "weights version per token (-1 for prompt tokens)",
    "distill_token_ids": "list of top-k token ids per token",
    "distill_logprobs": "list of top-k logprobs per token",
}
# Atropos's API refuses a message without these keys; so do we, so that an environment tested
# against either server behaves the same on the other.
MESSAGE_KEYS = ("role", "content")


@dataclass(frozen=True)
class Limits:
    """What the registered trainer can take."""

    batch_size: int
    max_token_len: int


def check_group(group: ScoredData, limits: Limits) -> None:
    """Raise GroupRejected, pointing at the offending field, if `group` must not be queued."""
    check_shape(group)
    for i, tokens in enumerate(group.tokens):
        if len(tokens) > limits.max_token_len:
            raise GroupRejected(
                ("body", "tokens", i),
                f"has {len(tokens)} tokens, more than the trainer's max_token_len="
                f"{limits.max_token_len}; truncate or drop the sequence before posting",
            )
    size = len(group.tokens)
    if size > limits.batch_size:
        raise GroupRejected(
            ("body", "tokens"),
            f"holds {size} sequences but the trainer's batch_size is {limits.batch_size}; groups "
            f"are never split, so it could never be served; send at most {limits.batch_size}",
        )


def check_shape(group: ScoredData) -> None:
    """Raise GroupRejected unless `group`'s fields line up: one row per sequence, one entry per
    token, parallel distillation top-k, messages with role and content. Needs no trainer, so the
    trainer runs it too on every group it is served (example_trainer/data/api_client.py)."""
    size = len(group.tokens)
    if size == 0:
        raise GroupRejected(("body", "tokens"), "is empty; a group needs at least one sequence")

    _check_distill_is_paired(group)
    for name in REQUIRED_PER_SEQUENCE + OPTIONAL_PER_SEQUENCE:
        values = getattr(group, name)
        if name in OPTIONAL_PER_SEQUENCE and not values:
            continue
        if len(values) != size:
            raise GroupRejected(
                ("body", name),
                f"has {len(values)} entries but tokens has {size} sequences; "
                "send one entry per sequence",
            )

    for i, tokens in enumerate(group.tokens):
        if not tokens:
            raise GroupRejected(("body", "tokens", i), "is empty; every sequence needs at least one token")
        for name in PER_TOKEN:
            rows = getattr(group, name)
            if rows and len(rows[i]) != len(tokens):
                what = PER_TOKEN_ENTRY.get(name, "value per token")
                raise GroupRejected(
                    ("body", name, i),
                    f"has {len(rows[i])} entries but tokens[{i}] has {len(tokens)}; send one {what}",
                )

    _check_distill_top_k(group)
    _check_routed_experts(group)
    _check_messages(group)


def _check_distill_is_paired(group: ScoredData) -> None:
    """The teacher's token ids mean nothing without their logprobs, and the other way round."""
    ids, logprobs = (bool(getattr(group, name)) for name in DISTILL_PAIR)
    if ids != logprobs:
        sent, missing = DISTILL_PAIR if ids else DISTILL_PAIR[::-1]
        raise GroupRejected(
            ("body", missing),
            f"is missing but {sent} is sent; send both (shape [sequence][position][top_k]) or neither",
        )


def _check_distill_top_k(group: ScoredData) -> None:
    """Each position's top-k ids and logprobs are parallel lists. Runs after the per-token
    checks, so both fields have the same number of rows and positions here."""
    if not group.distill_token_ids:
        return
    for i, (id_rows, logprob_rows) in enumerate(zip(group.distill_token_ids, group.distill_logprobs)):
        for j, (ids, logprobs) in enumerate(zip(id_rows, logprob_rows)):
            if len(ids) != len(logprobs):
                raise GroupRejected(
                    ("body", "distill_logprobs", i, j),
                    f"has {len(logprobs)} logprobs but distill_token_ids[{i}][{j}] has {len(ids)} "
                    "token ids; send one logprob per token id",
                )


def _check_routed_experts(group: ScoredData) -> None:
    """One row of routes per token but the last, and one model's shape (layers, top_k) in the group."""
    for i, (routes, tokens) in enumerate(zip(group.routed_experts or [], group.tokens)):
        if routes.positions() != len(tokens) - 1:
            raise GroupRejected(
                ("body", "routed_experts", i, "data"),
                f"holds {routes.positions():g} positions of {routes.layers} layers x {routes.top_k} {routes.dtype} "
                f"expert ids but tokens[{i}] has {len(tokens)} tokens; send one position per token but the last",
            )
        first = group.routed_experts[0]
        if (routes.layers, routes.top_k) != (first.layers, first.top_k):
            raise GroupRejected(
                ("body", "routed_experts", i),
                f"has {routes.layers} layers x top_k {routes.top_k} but routed_experts[0] has {first.layers} x "
                f"{first.top_k}; a group's routes come from one model",
            )


def _check_messages(group: ScoredData) -> None:
    for i, conversation in enumerate(group.messages or []):
        for j, message in enumerate(conversation):
            missing = [key for key in MESSAGE_KEYS if key not in message]
            if missing:
                raise GroupRejected(
                    ("body", "messages", i, j),
                    f"has no {' or '.join(map(repr, missing))}; every message needs 'role' and "
                    "'content' (other keys, such as 'reward', are kept as sent)",
                )
