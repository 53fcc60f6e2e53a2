"""The --beta reference: the starting policy's logprobs, with no deep copy of the model."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from example_trainer.rl.logprobs import sequence_logprobs
from example_trainer.rl.reference import DisabledAdapterReference, FrozenWeightsReference

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=True)
INPUTS = {"input_ids": torch.tensor([[1, 5, 7, 9, 11]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)


def test_the_frozen_reference_keeps_the_starting_weights_once_while_the_model_moves():
    model = tiny_model()
    start = sequence_logprobs(model, INPUTS, 0)
    reference = FrozenWeightsReference(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    assert not torch.allclose(sequence_logprobs(model, INPUTS, 0), start)
    torch.testing.assert_close(reference.logprobs(model, INPUTS, 0), start)
    # One tensor per parameter (the tied head is the embedding), and none shares the model's memory.
    assert len(reference.weights) == len(list(model.parameters()))
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not model_storages & {t.untyped_storage().data_ptr() for t in reference.weights.values()}


def test_the_lora_reference_is_the_base_with_the_adapter_off_and_holds_no_tensor():
    from peft import LoraConfig, get_peft_model

    model = tiny_model()
    base = sequence_logprobs(model, INPUTS, 0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))  # a non-zero adapter
    assert not torch.allclose(sequence_logprobs(peft_model, INPUTS, 0), base)
    reference = DisabledAdapterReference()
    torch.testing.assert_close(reference.logprobs(peft_model, INPUTS, 0), base)
    assert not any(isinstance(v, torch.Tensor) for v in vars(reference).values())
    assert not torch.allclose(sequence_logprobs(peft_model, INPUTS, 0), base)  # the adapter is back on
