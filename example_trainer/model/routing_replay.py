"""--routing-replay: the trainer's MoE layers send each token to the experts vLLM sent it to when it
sampled the completion, and weigh them with the trainer's own router.

Why: the trainer and vLLM compute the router's logits with different kernels, and where two
experts score close they pick different ones; such a token's logprob then differs by far more than
kernel rounding, and the policy ratio of GRPO on an MoE model turns into noise (runs are reported
to collapse). vLLM returns its routes (``--enable-return-routed-experts``, vllm_patching/routed_experts.py);
they travel with the group (``routed_experts``) to the batch (``TrainBatch.routes``).

How: one forward hook per router module (``mlp.gate``; PyTorch's own door, nothing of transformers
is patched), which, while routes are set, keeps the router's logits and replaces its choice by
vLLM's expert ids, with the weights recomputed from the router's own logits at those ids: softmax
over all experts, gathered, renormalised when ``norm_topk_prob`` (what ``Qwen3MoeTopKRouter`` does
for its own top-k), so the router still gets its gradient through the weights. Replaying the
model's own choice computes exactly what its forward does.

Routes stay set through the micro-batch's backward (``RoutingReplay.replaying`` wraps forward and
backward), so gradient checkpointing's recompute routes as the forward did. Chunked logprobs
(logprobs.py) change only the head. A sequence of n tokens has n - 1 positions of routes (the last
token was never fed forward); its last position and the padding get experts 0..top_k-1, which
change no logprob: attention is causal and an MoE layer mixes no positions.
"""

from __future__ import annotations

import base64
import contextlib
import re

import numpy as np
import torch

from api.models import RoutedExperts

# architecture -> the class of its routers (softmax over the experts, top-k, renormalised when
# norm_topk_prob). Another family needs its router's rule checked before it joins.
ROUTERS = {"Qwen3MoeForCausalLM": "Qwen3MoeTopKRouter"}
SERVER_FLAG_HINT = ("vLLM must run with --enable-return-routed-experts (the trainer adds it to the vLLM it starts; "
                    "with --launch-vllm false start yours with it) and the environment must pass /generate's "
                    "routed_experts on to the API (environments.base does)")


def check_architecture(architecture: str) -> None:
    """Refuse, at start, a model --routing-replay cannot replay."""
    if architecture not in ROUTERS:
        raise ValueError(f"--routing-replay: {architecture} has no MoE router this trainer can replay (supported: "
                         f"{', '.join(ROUTERS)}); drop --routing-replay for dense models")


def decode_routes(routes: RoutedExperts) -> torch.Tensor:
    """(positions, layers, top_k) int16 expert ids of one sequence's ``routed_experts``."""
    raw = np.frombuffer(base64.b64decode(routes.data), dtype=np.dtype(routes.dtype).newbyteorder("<"))
    if raw.size and int(raw.max()) > torch.iinfo(torch.int16).max:
        raise ValueError(f"routed_experts names expert {int(raw.max())}: more than int16 holds")
    return torch.from_numpy(raw.astype(np.int16).reshape(-1, routes.layers, routes.top_k))


class RoutingReplay:
    """Hooks on ``model``'s routers; ``replaying(routes)`` makes them route as vLLM did, and counts
    the routes where the trainer's router would have chosen otherwise (``sampling/routes_differ``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        architecture = (config.architectures or ["unknown"])[0]
        check_architecture(architecture)
        self.num_layers, self.top_k, self.num_experts = (config.num_hidden_layers, config.num_experts_per_tok,
                                                         config.num_experts)
        routers = [(int(re.search(r"layers\.(\d+)\.", name).group(1)), module) for name, module in model.named_modules()
                   if type(module).__name__ == ROUTERS[architecture]]
        if not routers:
            raise ValueError(f"--routing-replay: {architecture} has no {ROUTERS[architecture]} module (no MoE layer, "
                             "e.g. every layer in mlp_only_layers); drop --routing-replay")
        self.num_moe_layers = len(routers)
        self._routes: torch.Tensor | None = None  # (tokens, layers, top_k) while replaying
        self._counted: torch.Tensor | None = None  # (tokens,) bool: positions whose routes vLLM sent
        self._seen: set[int] = set()  # layers counted in this replay (a recompute or a reference pass counts no more)
        self.differing = self.routed = 0  # (position, MoE layer) pairs since take_counts
        self._hooks = [router.register_forward_hook(self._hook(layer)) for layer, router in routers]

    @contextlib.contextmanager
    def replaying(self, routes: torch.Tensor | None, attention_mask: torch.Tensor | None = None):
        """Route as ``routes`` (B, T, layers, top_k) say inside the block, which should hold the
        forward AND its backward (a checkpointed layer routes again there). ``attention_mask``
        (B, T): a row's real tokens; all but the last carry vLLM's routes and are counted. The
        model's own routing outside the block, or with ``routes`` None."""
        if routes is not None:
            self._check(routes)
            self._routes = routes.reshape(-1, self.num_layers, self.top_k)
            if attention_mask is not None:  # position t was fed forward by vLLM iff token t + 1 exists
                self._counted = torch.nn.functional.pad(attention_mask[:, 1:], (0, 1)).reshape(-1).bool()
        try:
            yield
        finally:
            self._routes, self._counted, self._seen = None, None, set()

    def take_counts(self) -> dict[str, float]:
        """{"differing", "routed"}: (position, MoE layer) pairs replayed since the last call, and those
        where the trainer's router picked other experts than vLLM; the counts start again."""
        counts = {"differing": float(self.differing), "routed": float(self.routed)}
        self.differing = self.routed = 0
        return counts

    def remove(self) -> None:
        """Take the hooks off: the model routes by itself again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _check(self, routes: torch.Tensor) -> None:
        if routes.dim() != 4 or tuple(routes.shape[2:]) != (self.num_layers, self.top_k):
            raise ValueError(f"--routing-replay: routes of shape {tuple(routes.shape)} for a model of "
                             f"{self.num_layers} layers routing each token to {self.top_k} experts: expected "
                             f"(batch, seq, {self.num_layers}, {self.top_k}). Were they sampled from another model?")
        if routes.numel() and (int(routes.max()) >= self.num_experts or int(routes.min()) < 0):
            raise ValueError(f"--routing-replay: routes name experts {int(routes.min())}..{int(routes.max())}, "
                             f"the model has {self.num_experts}")

    def _hook(self, layer: int):
        def replace_choice(router, args, output):
            """(logits, weights, ids) of the router -> the same logits, vLLM's ids, the router's weights at them."""
            if self._routes is None:
                return None
            logits, _, own = output  # (tokens, experts), _, (tokens, top_k)
            ids = self._routes[:, layer].to(device=logits.device, dtype=torch.long)  # (tokens, top_k)
            if ids.shape[0] != logits.shape[0]:
                raise RuntimeError(f"--routing-replay: layer {layer} routes {logits.shape[0]} tokens but the batch's "
                                   f"routes cover {ids.shape[0]}: the routes belong to another batch")
            if layer not in self._seen:
                self._seen.add(layer)
                self._count(own, ids)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
            if router.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), ids

        return replace_choice

    @torch.no_grad()
    def _count(self, own: torch.Tensor, replayed: torch.Tensor) -> None:
        differ = (own.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)  # (tokens,): another set
        if self._counted is not None:
            differ = differ[self._counted.to(differ.device)]
        self.differing += int(differ.sum())
        self.routed += differ.numel()
