"""bench/memory.py's model folders: real vocabulary sizes on SmolLM2's tokenizer."""

from __future__ import annotations

import pytest

from bench.memory import padded_tokenizer, shape_folder


def test_every_row_of_a_padded_vocabulary_decodes_and_text_encodes_as_before(default_model, tmp_path):
    from transformers import AutoTokenizer

    padded_tokenizer(default_model, tmp_path, 151936)
    tok, base = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(default_model)
    assert len(tok) == 151936
    assert tok.decode([49152, 151935]) == "<pad_49152><pad_151935>"  # random weights sample these rows
    text = "What is 15 times 7? <pad_49152>"  # no merges lead to the padding entries
    assert tok(text)["input_ids"] == base(text)["input_ids"]


def test_a_shape_folder_has_the_real_parameter_count(default_model, tmp_path):
    path, params = shape_folder("qwen2.5-1.5b", default_model, tmp_path)
    assert params == 1_543_714_304  # Qwen2.5-1.5B's count (tied embeddings)
    assert (tmp_path / "qwen2.5-1.5b" / "config.json").exists()


def test_checkpoint_interval_minus_one_means_never_and_below_is_refused():
    from example_trainer.config import TrainerConfig

    assert TrainerConfig(checkpoint_interval=-1).checkpoint_interval == -1
    with pytest.raises(ValueError, match="checkpoint-interval"):
        TrainerConfig(checkpoint_interval=-2)
