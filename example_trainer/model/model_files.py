"""What the trainer reads from a model folder before vLLM starts, without transformers' model classes.

The trainer starts vLLM first and imports the rest while vLLM loads: what it checks before the
start (the architecture's family, the memory plan's parameter count) comes from the folder's
``config.json`` and its safetensors headers. Importing transformers' auto classes took 7 s of an H100
machine's 13 s from launch to vLLM's start, scikit-learn, pandas, torch's compiler and torch's
tensor-parallel modules (3 s of it, which the trainer's own modules imported too) coming with them
(docs/results/time_to_accuracy_h100_581d17d_a/trainer_importtime.txt): both are imported where
they are used, after the start. The memory plan's activation estimate reads the model's shape
from ``config.json`` too (through transformers only where the file leaves a field to its class's
default).
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
    """The model class the config names ("unknown" when it names none); a folder that is not on
    disk (a hub id) through transformers, which finds it."""
    if (Path(model_path) / "config.json").is_file():
        names = getattr(read_config(model_path), "architectures", None)
    else:
        from transformers import AutoConfig

        names = AutoConfig.from_pretrained(model_path).architectures
    return (names or ["unknown"])[0]


def weight_files(model_path: str) -> list[Path]:
    """The safetensors files transformers loads from the folder: those its index names, else
    ``model.safetensors`` (a folder may hold other copies, e.g. Mistral's ``consolidated.safetensors``)."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def stored_parameter_count(model_path: str) -> int | None:
    """Parameters in the folder's weights, a head tied to the embedding counted once (as the
    model's ``parameters()`` count it); None when there are no safetensors weights, or a stored
    head whose tying the config leaves to its class's default."""
    files = weight_files(model_path)
    if not files:
        return None
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            shapes.update({name: tensors.get_slice(name).get_shape() for name in tensors.keys()})
    config = read_config(model_path)
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(getattr(config, "text_config", None), "tie_word_embeddings", None)
    if "lm_head.weight" in shapes:
        if tied is None:
            return None
        if tied:
            del shapes["lm_head.weight"]
    return sum(math.prod(shape) for shape in shapes.values())
