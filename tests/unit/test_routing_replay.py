"""--routing-replay on a tiny random Qwen3-MoE (4 experts, 2 per token, 2 layers), no vLLM: replaying
the model's own routes computes exactly its forward; other routes change the output while the
router keeps its gradient and only the replayed experts get theirs; gradient checkpointing and
chunked logprobs route the same; and the routes' way from vLLM's array to the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from api.models import RoutedExperts, ScoredData
from example_trainer.config import TrainerConfig
from example_trainer.data.batching import build_batch
from example_trainer.engine.vllm_process import vllm_server_args
from example_trainer.model.routing_replay import RoutingReplay, check_architecture, decode_routes
from example_trainer.rl.logprobs import sequence_logprobs
from tests.tiny_models import tiny_config
from vllm_patching.routed_experts import wire_routes

ARCH = "Qwen3MoeForCausalLM"
TOKENS = torch.tensor([[1, 5, 9, 42, 77, 3, 1200, 48000, 17, 256], [7, 7, 300, 12, 4000, 9, 2, 0, 0, 0]])
MASK = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])


def tiny_moe(dtype=torch.float32, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(ARCH, **overrides), dtype=dtype)


def own_routes(model) -> torch.Tensor:
    """(B, T, layers, top_k): the experts the model's routers pick for TOKENS by themselves."""
    picked = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: picked.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=TOKENS, attention_mask=MASK)
    for hook in hooks:
        hook.remove()
    return torch.stack([picked[i] for i in sorted(picked)], dim=1).reshape(*TOKENS.shape, len(picked), -1)


@pytest.mark.parametrize("dtype, norm_topk_prob", [(torch.bfloat16, False), (torch.float32, True)])
def test_replaying_the_models_own_routes_gives_exactly_its_logits(dtype, norm_topk_prob):
    model = tiny_moe(dtype, norm_topk_prob=norm_topk_prob)
    routes = own_routes(model)
    with torch.no_grad():
        plain = model(input_ids=TOKENS, attention_mask=MASK).logits
        replay = RoutingReplay(model)
        with replay.replaying(routes.to(torch.int16), MASK):
            replayed = model(input_ids=TOKENS, attention_mask=MASK).logits
    assert torch.equal(plain, replayed)
    assert replay.take_counts() == {"differing": 0.0, "routed": 2 * (9 + 6)}  # 2 layers x the positions vLLM fed
    replay.remove()


def test_other_routes_change_the_output_and_only_the_router_and_the_replayed_experts_learn():
    model = tiny_moe(norm_topk_prob=True)
    own = own_routes(model)
    routes = torch.tensor([1, 2]).expand_as(own).clone()  # every token to experts 1 and 2
    replay = RoutingReplay(model)
    with torch.no_grad():
        plain = model(input_ids=TOKENS, attention_mask=MASK).logits
    with replay.replaying(routes, MASK):
        logits = model(input_ids=TOKENS, attention_mask=MASK).logits
        logits[MASK.bool()].logsumexp(-1).sum().backward()
    assert (logits.detach() - plain).abs().max() > 1e-2
    counts = replay.take_counts()
    # layer 0 sees the same input either way (layer 1's own choice moves with layer 0's replayed output)
    first_layer = (own[:, :-1, 0].sort(-1).values != torch.tensor([1, 2])).any(-1)[MASK[:, 1:].bool()].sum()
    assert counts["routed"] == 2 * (9 + 6) and counts["differing"] >= first_layer > 0
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0  # the router learns through the weights
        expert_grads = layer.mlp.experts.gate_up_proj.grad.abs().sum(dim=(1, 2))  # (experts,)
        assert expert_grads[1] > 0 and expert_grads[2] > 0
        assert expert_grads[0] == 0 and expert_grads[3] == 0  # not replayed: no gradient


def test_outside_the_block_the_model_routes_by_itself():
    model = tiny_moe()
    with torch.no_grad():
        before = model(input_ids=TOKENS).logits
        replay = RoutingReplay(model)
        with replay.replaying(torch.tensor([0, 3]).expand_as(own_routes(model)).clone()):
            pass
        assert torch.equal(model(input_ids=TOKENS).logits, before)


def test_gradient_checkpointing_and_chunked_logprobs_route_as_replayed():
    """The recompute in backward runs inside the replay block: same routes, same gradients."""
    routes = torch.tensor([0, 3]).expand_as(own_routes(tiny_moe())).clone()
    inputs = {"input_ids": TOKENS, "attention_mask": MASK}
    grads = []
    for checkpointing, chunk in ((False, 0), (True, 4)):
        model = tiny_moe()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        replay = RoutingReplay(model)
        with replay.replaying(routes, MASK):
            sequence_logprobs(model, inputs, chunk).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert replay.take_counts()["routed"] == 2 * (9 + 6)  # the recompute is not counted again
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():  # chunking sums the head's products in another order (8e-6 of the largest)
        assert (grads[1][name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name


def test_a_model_without_moe_layers_is_refused_at_start():
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no MoE router.*drop --routing-replay"):
        check_architecture("Qwen3ForCausalLM")
    dense = AutoModelForCausalLM.from_config(tiny_config("Qwen3ForCausalLM"))
    with pytest.raises(ValueError, match="drop --routing-replay"):
        RoutingReplay(dense)
    with pytest.raises(ValueError, match="no Qwen3MoeTopKRouter module.*drop --routing-replay"):
        RoutingReplay(tiny_moe(mlp_only_layers=[0, 1]))


def test_routes_of_another_model_are_refused_naming_the_shapes():
    replay = RoutingReplay(tiny_moe())
    with pytest.raises(ValueError, match=r"expected \(batch, seq, 2, 2\)"):
        with replay.replaying(torch.zeros(2, 10, 3, 2, dtype=torch.int16)):
            pass
    with pytest.raises(ValueError, match="routes name experts 7..7, the model has 4"):
        with replay.replaying(torch.full((2, 10, 2, 2), 7, dtype=torch.int16)):
            pass


def routed_group(prompt: list[int], completions: list[list[int]], layers=2, top_k=2, **fields) -> ScoredData:
    """A group whose routes are vLLM's wire form: position t of row i routes to experts [t % 4, i]."""
    routes = []
    for i, c in enumerate(completions):
        n = len(prompt) + len(c)
        array = np.array([[[t % 4, i]] * layers for t in range(n - 1 + 3)], dtype=np.uint8)  # vLLM's may run longer
        routes.append(wire_routes(array, len(prompt), len(c)))
    return ScoredData(tokens=[prompt + c for c in completions], masks=[[-100] * len(prompt) + c for c in completions],
                      scores=[float(i) for i in range(len(completions))], routed_experts=routes, **fields)


def test_routes_travel_from_vllms_array_to_the_batch_shifted_like_nothing_else():
    batch = build_batch([routed_group([5, 6], [[7, 8, 9], [10]])], seq_len=8, routing_replay=True)
    assert batch.routes.shape == (2, 5, 2, 2) and batch.routes.dtype == torch.int16
    # row 0: 5 tokens, 4 positions of routes; its last position routes to 0..top_k-1
    assert batch.routes[0, :, 0].tolist() == [[0, 0], [1, 0], [2, 0], [3, 0], [0, 1]]
    # row 1: 3 tokens, 2 positions; then its last token and the padding
    assert batch.routes[1, :, 1].tolist() == [[0, 1], [1, 1], [0, 1], [0, 1], [0, 1]]
    assert batch.rows(1, 2).routes.shape == (1, 5, 2, 2)
    assert build_batch([routed_group([5, 6], [[7]])], seq_len=8).routes is None  # the flag off: not decoded


def test_a_batch_without_routes_is_refused_naming_the_server_flag():
    plain = ScoredData(tokens=[[1, 2, 3]], masks=[[-100, 2, 3]], scores=[1.0])
    with pytest.raises(ValueError, match=r"group\(s\) \[1\].*--enable-return-routed-experts"):
        build_batch([routed_group([1], [[2]]), plain], seq_len=8, routing_replay=True)
    with pytest.raises(ValueError, match="different models"):
        build_batch([routed_group([1], [[2]]), routed_group([1], [[2]], layers=3)], seq_len=8, routing_replay=True)


def test_wire_form_round_trips_and_cuts_to_the_kept_tokens():
    array = np.arange(10 * 3 * 2, dtype=np.uint16).reshape(10, 3, 2) * 5  # ids above 255: uint16
    wire = RoutedExperts(**wire_routes(array, prompt_tokens=4, completion_tokens=3))
    assert (wire.dtype, wire.layers, wire.top_k, wire.positions()) == ("uint16", 3, 2, 6)
    assert decode_routes(wire).tolist() == array[:6].tolist()
    small = RoutedExperts(**wire_routes(array[:, :, :1] % 7, 4, 3))
    assert small.dtype == "uint8" and decode_routes(small).tolist() == (array[:6, :, :1] % 7).tolist()
    with pytest.raises(ValueError, match=r"expected \[12, layers, top_k\]"):
        wire_routes(array, prompt_tokens=10, completion_tokens=3)
    assert wire_routes(None, 4, 3) is None


def test_the_launcher_starts_vllm_with_routes_on():
    assert "--enable-return-routed-experts" in vllm_server_args(TrainerConfig(routing_replay=True))
    assert "--enable-return-routed-experts" not in vllm_server_args(TrainerConfig())
