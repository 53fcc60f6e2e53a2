"""What the trainer reads from a model folder before vLLM starts, without transformers' model classes.

The trainer starts vLLM first and imports the rest while vLLM loads: what it checks before the
start (the architecture's family, the memory plan's parameter count) comes from the folder's
``config.json`` and its safetensors headers. Importing transformers' auto classes took 7 s of an H100
machine's 13 s from launch to vLLM's start, scikit-learn, pandas, torch's compiler and torch's
tensor-parallel modules (3 s of it, which the trainer's own modules imported too) coming with them
(docs/results/time_to_accuracy_h100_581d17d_a/trainer_importtime.txt): both are imported where
they are used, after the start. The memory plan's activation estimate still reads the config
through transformers, and only with gradient checkpointing, where it counts (above 1B parameters
by default).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

from safetensors import safe_open


def read_config(model_path: str) -> SimpleNamespace:
    """``config.json`` as attributes (nested configs too, e.g. ``text_config``)."""
    return json.loads((Path(model_path) / "config.json").read_text(),
                      object_hook=lambda fields: SimpleNamespace(**fields))


def architecture(model_path: str) -> str:
    """The model class the config names ("unknown" when it names none)."""
    return (getattr(read_config(model_path), "architectures", None) or ["unknown"])[0]


def stored_parameter_count(model_path: str) -> int | None:
    """Parameters in the folder's safetensors files, a weight tied to the embedding counted once (as
    the model's ``parameters()`` count it); None when the folder holds no safetensors weights."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            shapes.update({name: tensors.get_slice(name).get_shape() for name in tensors.keys()})
    config = read_config(model_path)
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return sum(math.prod(shape) for shape in shapes.values())
