# What the trainer's first forward/backward on the GPU spends its extra seconds on, and what removes them.
import os, sys, time
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
mode = sys.argv[1]
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from example_trainer.logprobs import sequence_logprobs
dev = torch.device("cuda")
torch.zeros(1, device=dev); torch.cuda.synchronize()

def smollm2(layers=30):
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, rope_theta=100000.0, torch_dtype="bfloat16")

def fwd_bwd(m, n, T):
    ids = torch.randint(0, 1000, (n, T), device=dev)
    torch.cuda.synchronize(); t = time.perf_counter()
    lp = sequence_logprobs(m, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 1024)
    lp.float().sum().backward()
    torch.cuda.synchronize()
    m.zero_grad(set_to_none=True)
    return round(time.perf_counter() - t, 3)

model = LlamaForCausalLM(smollm2()).to(dev, torch.bfloat16).train()
if mode == "tiny_model_first":
    tiny = LlamaForCausalLM(smollm2(layers=1)).to(dev, torch.bfloat16).train()
    print("tiny 1-layer model warm-up (2x16):", fwd_bwd(tiny, 2, 16), flush=True)
if mode == "imports_first":
    t = time.perf_counter()
    for name in open("/tmp/first_call_modules.txt").read().split():
        try:
            __import__(name)
        except Exception as e:
            print("import failed", name, e)
    print("imports first:", round(time.perf_counter() - t, 2), flush=True)
before = set(sys.modules)
first = fwd_bwd(model, 64, 200)
new = sorted(set(sys.modules) - before)
print(mode, "first fwd/bwd 64x200:", first, "modules imported by it:", len(new), flush=True)
if mode == "plain":
    open("/tmp/first_call_modules.txt", "w").write("\n".join(new))
    print("  top-level of them:", sorted({n.split(".")[0] + "." + n.split(".")[1] if "." in n else n for n in new})[:60])
print(mode, "second:", fwd_bwd(model, 64, 200), "third:", fwd_bwd(model, 64, 200), flush=True)
