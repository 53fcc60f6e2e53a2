"""The GGUF conversion of a packaged model (example_trainer/model/default_model.py) checks the
tokenizer it made: transformers 5.17 converted Gemma 3's GGUF tokenizer with no merges in effect
(one token per character), silently, and every prompt then overflowed the environment's rows."""

from __future__ import annotations

import pytest
import transformers

from example_trainer.model import default_model
from example_trainer.model.default_model import PackagedModel, check_tokenizer


class PerCharacter:
    """A tokenizer with no merges: one id per character."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class PerWord:
    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))


def test_a_tokenizer_with_no_merges_is_refused_naming_transformers_and_no_folder_is_left(tmp_path, monkeypatch):
    gguf = tmp_path / "package" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: PerCharacter())

    def no_model(*args, **kwargs):  # the check comes first: no ~30 s model conversion for nothing
        raise AssertionError("the model was converted before the tokenizer was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError) as refused:
        default_model._convert_gguf(gguf, cache / "gemma", PackagedModel("gemma", lambda scratch: gguf))
    message = str(refused.value)
    assert f"transformers {transformers.__version__}" in message and "5.23" in message
    assert "pip install" in message
    assert list(cache.iterdir()) == []  # no cache folder, finished or half-written


def test_a_tokenizer_with_merges_passes():
    check_tokenizer(PerWord(), "model.gguf")
