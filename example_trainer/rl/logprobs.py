"""Per-token logprobs of a model on a batch, with the vocabulary projection in chunks where it can.

The full path materialises (B, T, V) logits and their fp32 log-softmax: at B=8, T=2048 and a
128k vocabulary that is 8 GiB in fp32 before the backward keeps its own copy. The chunked path
runs the decoder, then the output projection a chunk of positions at a time
(``loss.chunked_token_logprobs``), for the model families whose forward is exactly
decoder → lm_head (no logit scaling or soft-capping after it: ``Family.plain_head``).
"""

from __future__ import annotations

import torch

from example_trainer.model.families import FAMILIES
from example_trainer.model.shared_prefix import PackedRows
from example_trainer.parallel import is_dtensor
from example_trainer.rl.loss import chunked_token_logprobs, token_logprobs


def projects_in_chunks(model: torch.nn.Module, chunk_tokens: int) -> bool:
    """Whether ``sequence_logprobs`` runs the decoder, then the output projection in chunks: for a
    positive ``chunk_tokens`` and a family whose forward is exactly decoder -> lm_head (a plain
    Linear, no bias). A tensor-parallel head (a DTensor) gathers its logits in its own forward."""
    head = model.get_output_embeddings()
    # A config built in code names no architectures: the model's class is its architecture then.
    known = FAMILIES.get((model.config.architectures or [type(model).__name__])[0])  # no entry: the model's own forward
    plain = known is not None and known.plain_head and type(head) is torch.nn.Linear and head.bias is None
    return chunk_tokens > 0 and plain and not is_dtensor(head.weight)


def sequence_logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], chunk_tokens: int,
                      weights: dict[str, torch.Tensor] | None = None, packed: PackedRows | None = None) -> torch.Tensor:
    """(B, T-1) logprob of each next token of ``inputs["input_ids"]``.

    ``chunk_tokens`` > 0 projects onto the vocabulary that many positions at a time where the
    model allows it (``projects_in_chunks``; else through the model's own logits). ``weights``:
    tensors to compute with in place of the model's parameters, by parameter name (None: its own).
    ``packed`` (--share-group-prefix): the decoder runs on these packed rows instead, its output
    gathered back to ``inputs``' layout; only where ``projects_in_chunks`` (the model's own logits
    would be (B, T, V) gathered from packed ones)."""
    tokens = inputs["input_ids"]
    if not projects_in_chunks(model, chunk_tokens):
        if packed is not None:
            raise ValueError("packed rows need the chunked projection (projects_in_chunks); this model computes "
                             "its own logits")
        if weights is None:
            logits = model(**inputs).logits
        else:
            logits = torch.func.functional_call(model, weights, args=(), kwargs=inputs).logits
        return token_logprobs(logits, tokens)
    head = model.get_output_embeddings()
    decoder = model.get_decoder()
    decoder_inputs = inputs if packed is None else packed.inputs
    if weights is None:
        hidden, head_weight = decoder(**decoder_inputs).last_hidden_state, head.weight
    else:
        prefix = next(name for name, module in model.named_modules() if module is decoder) + "."
        own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        hidden = torch.func.functional_call(decoder, own, args=(), kwargs=decoder_inputs).last_hidden_state
        head_weight = weights[next(n for n, p in model.named_parameters() if p is head.weight)]
    if packed is not None:
        hidden = packed.unpack(hidden)
    return chunked_token_logprobs(hidden, head_weight, tokens, chunk_tokens)
