"""--torch-compile: the trainer's decoder layers through torch.compile.

Every layer of a Hugging Face decoder runs the same code, so compiling each layer module (rather
than the whole model) gives one graph that all layers share, compiled once: torch.compile treats
the layer's parameters as inputs (``inline_inbuilt_nn_modules``, on by default since torch 2.5).
The parameters stay the tensors the bridge attached (views of vLLM's storage in shared_vllm), so
the optimizer's in-place update reaches the compiled layers as it reaches eager ones. Batches
change shape every step (rows and padded length): the graph is compiled dynamic in both from the
start rather than recompiled on the second shape. Gradient checkpointing wraps each compiled layer
the same way it wraps an eager one.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("onecopy.trainer.compile")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's repeated layers (``model.get_decoder().layers``, as the Llama, Qwen2 and Qwen3
    families name them); a clear error for a model without them."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"--torch-compile compiles the decoder's layers, and {type(model).__name__} has no "
                         "get_decoder().layers: run without --torch-compile")
    return layers


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile each decoder layer in place (``nn.Module.compile``) with torch.compile's ``backend``;
    returns how many. The compile itself happens at the first forward."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
    logger.info("[compile] torch.compile: %d decoder layers (%s), compiled at the first forward",
                len(layers), type(layers[0]).__name__)
    return len(layers)
