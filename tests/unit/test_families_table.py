"""The README's table of models follows example_trainer/model/families.py: one row per architecture
that has an entry (and none without), its tensor-parallel column as the entry says, and a user
with any other architecture is told, by the README and by the refusal itself, what to use."""

from __future__ import annotations

import re

import pytest

from example_trainer.model.families import FAMILIES, family
from tests.conftest import ROOT

README = ROOT / "README.md"
HEADER = ["architecture", "example checkpoints", "single copy", "tensor parallel", "notes"]


def models_section() -> str:
    text = README.read_text()
    start = text.index("\n## Models\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def table_rows() -> list[list[str]]:
    """The cells of every row of the section's table, the header first (the |---| line left out)."""
    lines = [line for line in models_section().splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if not set(line) <= set("|-")]


def architecture_rows() -> dict[str, list[str]]:
    return {m.group(1): row for row in table_rows()[1:] if (m := re.fullmatch(r"`(\w+)`", row[0]))}


def test_the_table_has_the_columns_a_user_looks_for():
    header, *rows = table_rows()
    assert header == HEADER
    assert all(len(row) == len(HEADER) for row in rows), [row for row in rows if len(row) != len(HEADER)]


def test_the_table_has_a_row_for_every_family_and_only_those():
    rows = architecture_rows()
    missing, stale = sorted(set(FAMILIES) - set(rows)), sorted(set(rows) - set(FAMILIES))
    assert not missing, (f"README.md's Models table lacks {missing}: add a row each, e.g. "
                         + "; ".join(f"| `{a}` | checkpoints | yes | {'yes' if FAMILIES[a].tensor_parallel else 'no'} "
                                     "| notes |" for a in missing))
    assert not stale, f"README.md's Models table lists {stale}, which example_trainer/model/families.py does not map"


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_each_row_says_what_the_families_entry_does(architecture):
    row = architecture_rows().get(architecture)
    if row is None:
        pytest.skip("no row (test_the_table_has_a_row_for_every_family_and_only_those says so)")
    assert row[2] == "yes", f"{architecture}: it has a single-copy entry"
    assert row[3] == ("yes" if FAMILIES[architecture].tensor_parallel else "no"), (
        f"{architecture}: families.py says tensor_parallel={FAMILIES[architecture].tensor_parallel}")
    assert row[1], f"{architecture}: name a checkpoint a user may arrive with"


def test_any_other_architecture_is_refused_naming_the_table_and_the_fallback():
    other = [row for row in table_rows()[1:] if row[0] == "any other"]
    assert other and other[0][2:4] == ["no", "no"]
    assert "--weight-bridge-mode none" in models_section()
    with pytest.raises(ValueError) as refused:
        family("GPT2LMHeadModel")
    message = str(refused.value)
    assert all(architecture in message for architecture in architecture_rows()), message
    assert "--weight-bridge-mode none" in message
