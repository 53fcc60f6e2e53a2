"""Weight bridges, one class per ``--weight-bridge-mode`` (and one for shared_vllm's tensor-parallel
variant), named by the mode's row in ``example_trainer/modes.py``."""

from __future__ import annotations

import importlib

from example_trainer.bridges.base import WeightBridge
from example_trainer.modes import mode_facts


def bridge_class(mode: str, parallel: str = "none") -> type[WeightBridge]:
    """The bridge class of ``mode`` under ``--parallel`` (its row's ``bridge_for``); an unknown
    mode fails with the list of valid ones."""
    module, name = mode_facts(mode).bridge_for(parallel).split(":")
    return getattr(importlib.import_module(module), name)
