"""bench/shapes.py's model folders (bench/memory.py, tests/gpu): real vocabulary sizes on SmolLM2's tokenizer."""

from __future__ import annotations

import pytest

from bench.shapes import padded_tokenizer, shape_folder


def test_every_row_of_a_padded_vocabulary_decodes_and_text_encodes_as_before(default_model, tmp_path):
    from transformers import AutoTokenizer

    padded_tokenizer(default_model, tmp_path, 151936)
    tok, base = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(default_model)
    assert len(tok) == 151936
    assert tok.decode([49152, 151935]) == "<pad_49152><pad_151935>"  # random weights sample these rows
    text = "What is 15 times 7? <pad_49152>"  # no merges lead to the padding entries
    assert tok(text)["input_ids"] == base(text)["input_ids"]


@pytest.mark.parametrize("shape, params", [
    ("qwen2.5-1.5b", 1_543_714_304),  # tied embeddings
    ("qwen3-8b", 8_190_735_360),
    ("qwen3-30b-a3b", 30_532_122_624),  # 128 experts a layer
])
def test_a_shape_folder_has_the_real_parameter_count(shape, params, default_model, tmp_path):
    path, counted = shape_folder(shape, default_model, tmp_path)
    assert counted == params  # the real checkpoint's count
    assert (tmp_path / shape / "config.json").exists()


def test_checkpoint_interval_minus_one_means_never_and_below_is_refused():
    from example_trainer.config import TrainerConfig

    assert TrainerConfig(checkpoint_interval=-1).checkpoint_interval == -1
    with pytest.raises(ValueError, match="checkpoint-interval"):
        TrainerConfig(checkpoint_interval=-2)
