"""Forward + backward of 4 Llama-3.1-8B decoder layers on 12,288 tokens (64 x 192, the 8B head-to-head's
batch), gradient checkpointing and torch.compile as the trainer runs them, nothing else on the GPU:
bf16 against --float8-matmuls backward, and torchao's tensorwise recipe (forward in float8 too) for
reference. Medians of 10 timed calls after 3 warm-ups, in the order bf16, backward, tensorwise, bf16."""
import statistics, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from example_trainer.compilation import compile_decoder_layers
from example_trainer.float8_matmuls import convert_projections

def model(recipe):
    torch.manual_seed(0); torch._dynamo.reset()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128)
    m = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    if recipe == "backward":
        convert_projections(m, "backward", torch.device("cuda"))
    elif recipe == "tensorwise":
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(m.model, module_filter_fn=lambda mod, n: n.rsplit(".", 1)[-1].endswith("proj"))
    m.gradient_checkpointing_enable(); compile_decoder_layers(m)
    return m

def time_it(m):
    x = torch.randint(0, 128, (64, 192), device="cuda")
    times = []
    for i in range(13):
        torch.cuda.synchronize(); t = time.perf_counter()
        m(input_ids=x).logits.float().mean().backward()
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    return statistics.median(times[3:])

for recipe in ["bf16", "backward", "tensorwise", "bf16"]:
    m = model(recipe); print(f"{recipe:10s} fwd+bwd of 4 layers: {time_it(m)*1e3:7.1f} ms", flush=True); del m
