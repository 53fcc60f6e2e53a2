"""The bf16 rounding trap: tiny Adam steps vanish in bf16 but accumulate in fp32 masters."""

import pytest
import torch

from example_trainer.bridges.master_weights import MasterWeights

STEPS, LR = 60, 1e-6


def run(steps: int, use_masters: bool) -> torch.Tensor:
    # 0.01 in bf16: neighbouring values are 2**-14 ≈ 6.1e-5 apart, so one Adam step (≈ lr) is
    # far below half a step and rounds away; 60 steps (≈ 6e-5) must move it in the master path.
    shared = torch.full((4,), 0.01, dtype=torch.bfloat16, requires_grad=True)
    masters = MasterWeights([shared]) if use_masters else None
    opt = torch.optim.AdamW(masters.params if masters else [shared], lr=LR, weight_decay=0.0)
    for _ in range(steps):
        (shared.float() * 1.0).sum().backward()  # gradient +1 everywhere: Adam steps -lr
        if masters:
            masters.pull_grads()
        opt.step()
        opt.zero_grad()
        if masters:
            masters.push()
    return shared.detach().clone()


def test_pure_bf16_steps_round_away():
    start = torch.full((4,), 0.01, dtype=torch.bfloat16)
    assert torch.equal(run(STEPS, use_masters=False), start)


def test_master_weights_still_change_the_bf16_weights():
    start = torch.full((4,), 0.01, dtype=torch.bfloat16)
    after = run(STEPS, use_masters=True)
    assert (after < start).all()


def test_push_writes_in_place():
    shared = torch.zeros(3, dtype=torch.bfloat16)
    ptr = shared.data_ptr()
    masters = MasterWeights([shared])
    with torch.no_grad():
        masters.params[0].fill_(1.5)
    masters.push()
    assert shared.data_ptr() == ptr and shared.tolist() == [1.5, 1.5, 1.5]


def test_on_cpu_the_forward_runs_on_the_fp32_masters_and_their_gradients_are_kept(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from example_trainer.bridges.base import WeightBridge
    from example_trainer.config import TrainerConfig

    class MastersOnly(WeightBridge):  # the base class's own logic; no vLLM behind it
        def attach(self):
            raise NotImplementedError

        def sync(self, model, step, final):
            return {}

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    bridge = MastersOnly(TrainerConfig(), "unused", tmp_path, torch.device("cpu"))
    bridge.masters = MasterWeights(list(model.parameters()))
    weights = bridge.forward_parameters(model)
    assert set(weights) == {n for n, _ in model.named_parameters()}
    assert all(w.dtype == torch.float32 for w in weights.values())
    ids = torch.tensor([[1, 5, 7, 9]])
    logits = torch.func.functional_call(model, weights, args=(), kwargs={"input_ids": ids}).logits
    assert logits.dtype == torch.float32
    logits.mean().backward()
    bridge.gradients_ready(model)  # pulls bf16 gradients: there are none, the masters' stay
    assert all(m.grad is not None and m.grad.abs().sum() > 0 for m in bridge.masters.params)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("start", [0.01, 1.0])
@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "adamwfp8", "adamw4bit"])
def test_without_masters_stochastic_rounding_keeps_tiny_steps_on_average(name, start):
    """The lean path (--bf16-inplace): the optimizer steps bf16 weights directly; 60 steps of
    about 1e-6 each move a weight by about 6e-5 on average instead of not at all (bf16's spacing
    is 2^-14 near 0.01 and 2^-8 just below 1, so every single step rounds)."""
    from example_trainer.optim.optimizers import build_optimizer

    torch.manual_seed(0)
    weights = torch.full((65536,), start, dtype=torch.bfloat16, requires_grad=True)
    opt = build_optimizer(name, [weights], lr=LR, weight_decay=0.0)
    for _ in range(STEPS):
        weights.grad = torch.ones_like(weights)  # Adam steps -lr
        opt.step()
        opt.zero_grad()
    moved = torch.tensor(start, dtype=torch.bfloat16).item() - weights.detach().float().mean().item()
    assert weights.dtype == torch.bfloat16
    assert moved == pytest.approx(STEPS * LR, rel=0.25), moved


@pytest.mark.parametrize("name", ["adamw8bit", "adamwfp8", "adamw4bit"])
def test_quantised_optimizer_state_survives_a_checkpoint_round_trip(name):
    import io

    from example_trainer.optim.optimizers import build_optimizer

    torch.manual_seed(0)
    weights = torch.randn(4096, requires_grad=True)
    twin = weights.detach().clone().requires_grad_(True)
    opt = build_optimizer(name, [weights], lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        weights.grad = torch.randn_like(weights)
        opt.step()
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    twin.data.copy_(weights.detach())
    resumed = build_optimizer(name, [twin], lr=1e-3, weight_decay=0.0)
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    grad = torch.randn_like(weights)
    weights.grad, twin.grad = grad, grad.clone()
    opt.step()
    resumed.step()
    assert torch.equal(weights, twin)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_tensors_stepped_in_row_blocks_get_the_whole_tensors_update(name):
    """--optimizer-chunk-elements: a 64x256 weight stepped as four 16-row blocks ends where the
    whole tensor does, and the blocks hold no gradient after the step (zero_grad frees it)."""
    from example_trainer.optim.optimizers import RowBlockOptimizer, build_optimizer

    torch.manual_seed(0)
    whole = torch.randn(64, 256, requires_grad=True)
    in_blocks = whole.detach().clone().requires_grad_(True)
    small = torch.randn(256, requires_grad=True)  # below the limit: stepped whole either way
    reference = build_optimizer(name, [whole, small], lr=1e-2, weight_decay=0.1)
    blocked = build_optimizer(name, [in_blocks, small.detach().clone().requires_grad_(True)], lr=1e-2,
                              weight_decay=0.1, chunk_elements=16 * 256)
    assert isinstance(blocked, RowBlockOptimizer) and [len(views) for _, _, views in blocked.blocks] == [4]
    for _ in range(3):
        grad = torch.randn_like(whole)
        whole.grad, in_blocks.grad = grad, grad.clone()
        small.grad = blocked.params[1].grad = torch.ones(256)
        reference.step()
        blocked.step()
        reference.zero_grad()
        blocked.zero_grad()
    torch.testing.assert_close(in_blocks, whole, rtol=0, atol=1e-6)
    assert in_blocks.grad is None and all(view.grad is None for view in blocked.blocks[0][2])
    assert len(blocked.state_dict()["optimizer"]["state"]) == 5  # four blocks and the small tensor


def test_row_blocks_are_whole_quantisation_runs_and_released_views_free_the_storage():
    """Blocks of a 640-wide weight hold an even number of rows (640 * rows a multiple of 256, so
    torchao quantises each block's moments); release() drops every view, which with --bf16-inplace
    maps vLLM's memory."""
    import gc
    import weakref

    from example_trainer.optim.optimizers import build_optimizer

    weight = torch.randn(8, 640, dtype=torch.bfloat16, requires_grad=True)
    opt = build_optimizer("adamw8bit", [weight], lr=1e-3, weight_decay=0.0, chunk_elements=3 * 640)
    assert [rows for _, rows, _ in opt.blocks] == [2]
    weight.grad = torch.ones_like(weight)
    opt.step()
    view = weakref.ref(opt.blocks[0][2][0])
    opt.release()
    gc.collect()
    assert view() is None


def test_optimizer_state_of_another_block_layout_is_refused_by_name():
    from example_trainer.optim.optimizers import build_optimizer

    weight = torch.randn(64, 256, requires_grad=True)
    whole = build_optimizer("adamw", [weight], lr=1e-3, weight_decay=0.0)
    weight.grad = torch.ones_like(weight)
    whole.step()
    blocked = build_optimizer("adamw", [weight], lr=1e-3, weight_decay=0.0, chunk_elements=16 * 256)
    with pytest.raises(ValueError, match="--optimizer-chunk-elements 0"):
        blocked.load_state_dict(whole.state_dict())
    # A plain torch state (a checkpoint from before the row blocks) loads where nothing is in blocks.
    build_optimizer("adamw", [weight], lr=1e-3, weight_decay=0.0).load_state_dict(whole.optimizer.state_dict())
