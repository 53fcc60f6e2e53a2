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
REQUIRED_PER_SEQUENCE = ("masks", "scores")
OPTIONAL_PER_SEQUENCE = ("advantages", "ref_logprobs", "inference_logprobs")
PER_TOKEN = ("masks", "advantages", "ref_logprobs", "inference_logprobs")


@dataclass(frozen=True)
class Limits:
    """What the registered trainer can take."""

    batch_size: int
    max_token_len: int


def check_group(group: ScoredData, limits: Limits) -> None:
    """Raise GroupRejected, pointing at the offending field, if `group` must not be queued."""
    size = len(group.tokens)
    if size == 0:
        raise GroupRejected(("body", "tokens"), "is empty; a group needs at least one sequence")

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
                what = "mask entry per token (-100 for prompt tokens)" if name == "masks" else "value per token"
                raise GroupRejected(
                    ("body", name, i),
                    f"has {len(rows[i])} entries but tokens[{i}] has {len(tokens)}; send one {what}",
                )
        if len(tokens) > limits.max_token_len:
            raise GroupRejected(
                ("body", "tokens", i),
                f"has {len(tokens)} tokens, more than the trainer's max_token_len="
                f"{limits.max_token_len}; truncate or drop the sequence before posting",
            )

    if size > limits.batch_size:
        raise GroupRejected(
            ("body", "tokens"),
            f"holds {size} sequences but the trainer's batch_size is {limits.batch_size}; groups "
            f"are never split, so it could never be served; send at most {limits.batch_size}",
        )
