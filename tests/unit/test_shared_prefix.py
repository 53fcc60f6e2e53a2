"""--share-group-prefix: each group's prompt computed once gives the padded forward's logprobs,
loss and gradients (the trainer's own forward_backward, fp32, several families, micro-batches that
split a group, rows of different lengths, a row that is all prompt, sdpa and eager attention), with
the layout and the attention's ways there and back checked on a hand-written case, and packing
declined where it would not save positions."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from api.models import ScoredData
from example_trainer.config import TrainerConfig
from example_trainer.data.batching import build_batch
from example_trainer.grpo import forward_backward
from example_trainer.model.shared_prefix import (PACKED_PREFIX, PackedRows, pack_for_model, pack_shared_prefixes,
                                                 packing_applies, packing_pays)
from example_trainer.rl.logprobs import sequence_logprobs
from tests.tiny_models import tiny_config


def scored_group(prompt: list[int], completions: list[list[int]], scores: list[float]) -> ScoredData:
    return ScoredData(tokens=[prompt + c for c in completions], masks=[[-100] * len(prompt) + c for c in completions],
                      scores=scores, inference_logprobs=[[1.0] * len(prompt) + [-2.0] * len(c) for c in completions])


def batch_of_groups():
    """Three groups of 4: prompts of 9, 12 and 9 tokens (the first and last start alike), completions
    of 1 to 7 tokens; the last group's first completion is one token its siblings also start with."""
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(5, 1000, (n,), generator=g).tolist()  # noqa: E731
    head = rand(4)
    groups = [scored_group(head + rand(5), [rand(n) for n in (3, 7, 1, 5)], [1.0, 0.0, 0.5, 0.0]),
              scored_group(rand(12), [rand(n) for n in (6, 2, 4, 4)], [0.0, 1.0, 1.0, 0.0])]
    first = rand(1)
    groups.append(scored_group(head + rand(5), [first, first + rand(3), first + rand(6), rand(2)], [1.0, 0.0, 0.0, 1.0]))
    return build_batch(groups, seq_len=64)


def model_of(arch: str, attn: str = "sdpa", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(arch, **overrides)
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def loss_and_gradients(model, batch, share: bool, accumulation: int = 1, weights=None, reference=None):
    cfg = TrainerConfig(batch_size=12, gradient_accumulation_steps=accumulation, share_group_prefix=share,
                        logprob_chunk_tokens=16, epsilon=0.05, beta=0.1 if reference else 0.0)
    model.zero_grad(set_to_none=True)
    metrics = forward_backward(model, reference, batch, cfg, torch.device("cpu"), weights)
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
# 1: the three groups of 4 in one pass; 3: one group a micro-batch; 4: micro-batches of 3 rows that split
# every group (rows 0-2, 3-5, 6-8, 9-11: one row of a group alone in one, with rows of the next)
@pytest.mark.parametrize("accumulation", [1, 3, 4])
def test_the_packed_forward_gives_the_padded_ones_loss_metrics_and_gradients(arch, accumulation):
    batch = batch_of_groups()
    model = model_of(arch)
    padded_metrics, padded_grads = loss_and_gradients(model, batch, share=False, accumulation=accumulation)
    packed_metrics, packed_grads = loss_and_gradients(model, batch, share=True, accumulation=accumulation)

    assert packed_metrics["train/forward_positions_saved"] > 0.2  # it packed, and skipped positions
    for name in ("train/loss", "sampling/importance_ratio/mean", "sampling/logp_difference/mean"):
        assert packed_metrics[name] == pytest.approx(padded_metrics[name], rel=1e-4, abs=1e-6), name
    assert padded_grads.keys() == packed_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_eager_attention_is_gathered_too():
    batch = batch_of_groups()
    model = model_of("LlamaForCausalLM", attn="eager")
    padded, padded_grads = loss_and_gradients(model, batch, share=False)
    packed, packed_grads = loss_and_gradients(model, batch, share=True)
    assert model.config._attn_implementation == PACKED_PREFIX + "eager"
    assert packed["train/forward_positions_saved"] > 0.2
    assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-4, abs=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_layout_on_a_hand_written_case():
    # two groups: rows 0-1 share [7, 8], then row 0 has [1, 2] and row 1 [3]; row 2 is alone.
    tokens = torch.tensor([[7, 8, 1, 2], [7, 8, 3, 0], [5, 6, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    packed = pack_shared_prefixes(tokens, attention, torch.tensor([0, 0, 1]))
    assert packed.inputs["input_ids"].tolist() == [[7, 8, 1, 2, 3], [5, 6, 0, 0, 0]]
    assert packed.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    # the way back, and the attention's way to the padded rows: row 1's token 2 (the 3) is packed
    # position 4; padding points at a real position
    assert packed.index.tolist() == [[0, 1, 2, 3], [0, 1, 4, 0], [5, 6, 5, 5]]
    assert packed.inputs["packed_gather"].tolist() == packed.index.tolist()
    # the attention's way back, per packed position a flat padded (row * 4 + position): the prefix
    # from row 1 (the group's last row; row 0 computes the same), row 0's own tokens from row 0,
    # the 3 from row 1, the lone row from row 2, packed padding from position 0
    assert packed.inputs["packed_scatter"].tolist() == [4, 5, 2, 3, 6, 8, 9, 0, 0, 0]
    assert packed.saved == pytest.approx(1 - 10 / 12)


def test_packing_is_declined_where_it_saves_no_position_and_for_attention_it_does_not_wrap():
    # the 8B head-to-head's micro-batch: 4 groups of 16, 59-token prompts, 128-token completions
    assert packing_pays(64, 187, [59 + 16 * 128] * 4)
    # 2,048-token completions: the prompts are 2.6% of the positions, less than the gathers cost
    assert not packing_pays(64, 2048 + 59, [59 + 16 * 2048] * 4)
    tokens = torch.tensor([[7, 8, 1], [7, 8, 2]])
    ones = torch.ones_like(tokens)
    # rows of different groups share nothing: packing would save no position
    assert pack_shared_prefixes(tokens, ones, torch.tensor([0, 1])) is None
    model = model_of("LlamaForCausalLM")
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packing_applies(model)
    assert pack_for_model(model, tokens, ones, torch.tensor([0, 0]), torch.device("cpu")) is None
    assert model.config._attn_implementation == "flash_attention_2"  # not switched


def test_the_gathered_attention_leaves_a_padded_forward_as_it_was():
    """Once a model attends through the gathered attention, a micro-batch that is not packed (no
    indices) takes its own attention unchanged."""
    batch = batch_of_groups()
    model = model_of("Qwen3ForCausalLM")
    inputs = {"input_ids": batch.tokens, "attention_mask": batch.attention_mask}
    with torch.no_grad():
        before = sequence_logprobs(model, inputs, 16)
        assert pack_for_model(model, batch.tokens, batch.attention_mask, batch.groups, torch.device("cpu"))
        assert model.config._attn_implementation == PACKED_PREFIX + "sdpa"
        after = sequence_logprobs(model, inputs, 16)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_routing_replay_is_refused_with_it():
    with pytest.raises(ValueError, match="--share-group-prefix and --routing-replay do not go together"):
        TrainerConfig(share_group_prefix=True, routing_replay=True)


def test_a_model_that_computes_its_own_logits_stays_padded_and_reports_nothing_saved():
    """--logprob-chunk-tokens 0 (or a head that is not a plain Linear): the model's own forward
    computes the logits, which packed rows cannot serve; the metric says no position was saved."""
    batch = batch_of_groups()
    model = model_of("LlamaForCausalLM")
    cfg = TrainerConfig(batch_size=12, share_group_prefix=True, logprob_chunk_tokens=0, epsilon=0.05)
    metrics = forward_backward(model, None, batch, cfg, torch.device("cpu"))
    assert metrics["train/forward_positions_saved"] == 0.0


def test_a_model_whose_config_names_no_architecture_is_packed_by_its_class():
    """A config built in code (``LlamaConfig(...)``, as tests/gpu builds its model) has
    ``architectures`` None: the model's class names the family, and its rows are packed. Before, such
    a model stayed padded and the GPU test of the packed path checked the padded one against itself."""
    config = tiny_config("LlamaForCausalLM")
    config.architectures = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    cfg = TrainerConfig(batch_size=12, share_group_prefix=True, logprob_chunk_tokens=16, epsilon=0.05)
    metrics = forward_backward(model, None, batch_of_groups(), cfg, torch.device("cpu"))
    assert metrics["train/forward_positions_saved"] > 0.2


def test_the_weights_the_loop_passes_in_place_of_the_parameters_take_the_packed_path_too():
    """forward_backward's ``weights`` (a bridge's forward_parameters): the decoder runs through
    functional_call on the packed rows."""
    batch = batch_of_groups()
    model = model_of("Qwen3ForCausalLM")
    weights = {name: p for name, p in model.named_parameters()}
    padded, padded_grads = loss_and_gradients(model, batch, share=False, weights=weights)
    packed, packed_grads = loss_and_gradients(model, batch, share=True, weights=weights)
    assert packed["train/forward_positions_saved"] > 0.2
    assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-4, abs=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


# Windows of 8 cut the rows (10 to 19 tokens: T = 18); the packed rows are 28 long. Mistral slides on
# every layer, Qwen2 and Qwen3 from max_window_layers on, Olmo3 on its "sliding_attention" layers.
# (Gemma3 stays padded: its soft-capped logits are its own, logprobs.projects_in_chunks.)
SLIDING = [("MistralForCausalLM", {}),
           ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}),
           ("Qwen3ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}),
           ("Olmo3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"]})]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("arch", "overrides"), SLIDING, ids=[arch for arch, _ in SLIDING])
def test_a_sliding_window_shorter_than_the_rows_is_kept_on_the_packed_rows(monkeypatch, arch, overrides, attn):
    """Packing was declined wherever a row was longer than the window (the kernel was called without
    one). Now each sliding layer gets a banded mask in the padded layout: the padded forward's loss
    and gradients, and no mask of the packed rows' size (transformers would build a sliding one
    from any mask but a 4D one)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    batch = batch_of_groups()
    model = model_of(arch, attn, sliding_window=8, **overrides)
    padded, padded_grads = loss_and_gradients(model, batch, share=False)
    full = model_of(arch, attn, sliding_window=64, **overrides)  # wider than every row
    unwindowed, _ = loss_and_gradients(full, batch, share=False)
    assert unwindowed["train/loss"] != pytest.approx(padded["train/loss"], rel=1e-4)  # the window matters here
    assert pack_for_model(model, batch.tokens, batch.attention_mask, batch.groups, torch.device("cpu")) is not None
    built = []
    name = model.config._attn_implementation
    mask_of = ALL_MASK_ATTENTION_FUNCTIONS[name]
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name,
                        lambda *args, **kwargs: built.append(1) or mask_of(*args, **kwargs))
    packed, packed_grads = loss_and_gradients(model, batch, share=True)
    assert packed["train/forward_positions_saved"] > 0.2 and not built
    assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-4, abs=1e-6)
    for grad_name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[grad_name], grad, rtol=1e-4, atol=1e-5, msg=grad_name)


def test_a_layer_that_keeps_its_window_to_itself_raises_rather_than_attend_past_it():
    """A family that applied its sliding window through the mask alone, not passing it to the
    attention, would get the plain causal kernel here: every position seeing the whole row."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    batch = batch_of_groups()
    model = model_of("MistralForCausalLM", sliding_window=8)
    packed = pack_for_model(model, batch.tokens, batch.attention_mask, batch.groups, torch.device("cpu"))
    attention = model.get_decoder().layers[0].self_attn
    attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    rows, length = packed.inputs["input_ids"].shape
    q, k = torch.zeros(rows, 4, length, 32), torch.zeros(rows, 2, length, 32)  # 4 heads over 2 KV heads
    indices = {key: packed.inputs[key] for key in ("packed_gather", "packed_scatter")}
    attend(attention, q, k, k, packed.inputs["attention_mask"], sliding_window=8, **indices)  # passed: fine
    with pytest.raises(RuntimeError, match="does not pass its sliding window"):
        attend(attention, q, k, k, packed.inputs["attention_mask"], **indices)


def test_packed_rows_whose_indices_do_not_reach_the_attention_raise():
    """A family whose layers dropped their keyword arguments would attend over the packed row as it
    is, each completion seeing its siblings: the placeholder mask makes that an error."""
    batch = batch_of_groups()
    model = model_of("LlamaForCausalLM")
    packed = pack_for_model(model, batch.tokens, batch.attention_mask, batch.groups, torch.device("cpu"))
    inputs = {k: v for k, v in packed.inputs.items() if not k.startswith("packed_")}
    with pytest.raises(RuntimeError, match="without their indices"):
        model.get_decoder()(**inputs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [None, 8], ids=["causal", "sliding window"])
def test_the_gathered_attention_keeps_each_compiled_layer_one_graph(attn, window):
    """--torch-compile compiles each decoder layer: the gathered attention must not break its graph
    (an import of the family's eager function inside it did, 4 breaks a layer). Dynamo's explain
    traces one layer on the inputs the packed forward gives it (with a window: its banded mask)."""
    batch = batch_of_groups()
    model = model_of("LlamaForCausalLM", attn=attn) if window is None else \
        model_of("MistralForCausalLM", attn=attn, sliding_window=window)
    packed = pack_for_model(model, batch.tokens, batch.attention_mask, batch.groups, torch.device("cpu"))
    layer = model.get_decoder().layers[0]
    seen = {}
    hook = layer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(args=args, kwargs=kwargs),
                                           with_kwargs=True)
    with torch.no_grad():
        model.get_decoder()(**packed.inputs)
    hook.remove()
    try:
        with torch._dynamo.config.patch(disable=False):  # the CPU tests turn compiling off (tests/conftest.py)
            explained = torch._dynamo.explain(layer)(*seen["args"], **seen["kwargs"])
        assert explained.graph_count >= 1
        assert explained.graph_break_count == 0, [str(r.reason).splitlines()[:2] for r in explained.break_reasons]
    finally:
        torch._dynamo.reset()


def test_a_micro_batch_that_saves_under_five_percent_stays_padded():
    """The gathers around the attention cost a few percent: a saving smaller than that is not taken."""
    assert packing_pays(10, 10, [95]) and not packing_pays(10, 10, [96])


def test_the_kl_reference_runs_on_the_packed_rows_and_gives_the_padded_kl():
    from example_trainer.rl.reference import FrozenWeightsReference

    batch = batch_of_groups()
    model = model_of("LlamaForCausalLM")
    reference = FrozenWeightsReference(model)
    with torch.no_grad():  # the policy moves away from the frozen start, so the KL is not 0
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    padded, padded_grads = loss_and_gradients(model, batch, share=False, reference=reference)
    calls = []
    original = reference.logprobs
    reference.logprobs = lambda *args: calls.append(args[-1]) or original(*args)
    packed, packed_grads = loss_and_gradients(model, batch, share=True, reference=reference)
    assert calls and all(isinstance(p, PackedRows) for p in calls)  # the reference went through the packed rows
    assert padded["train/kl"] > 1e-6
    assert packed["train/kl"] == pytest.approx(padded["train/kl"], rel=1e-4)
    assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-4, abs=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
