# First forward/backward against later ones on the GPU, as the trainer runs them (bf16 model, logprob chunks)
import os, sys, time
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
from example_trainer.logprobs import sequence_logprobs
print("imports", round(time.perf_counter() - t0, 2), flush=True)
dev = torch.device("cuda")
t = time.perf_counter(); torch.cuda.init(); torch.zeros(1, device=dev); torch.cuda.synchronize()
print("context", round(time.perf_counter() - t, 2), flush=True)
m = AutoModelForCausalLM.from_pretrained(os.environ["SMOLLM2_DIR"], dtype=torch.bfloat16).to(dev)
m.train()
def step(n, T):
    ids = torch.randint(0, 1000, (n, T), device=dev)
    torch.cuda.synchronize(); t = time.perf_counter()
    lp = sequence_logprobs(m, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 1024)
    lp.float().sum().backward()
    torch.cuda.synchronize()
    m.zero_grad(set_to_none=True)
    return round(time.perf_counter() - t, 3)
mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
if mode == "small_first":
    print("small warm-up (2x16)", step(2, 16), flush=True)
for i in range(3):
    print(mode, "fwd/bwd 64x200 #%d" % i, step(64, 200), flush=True)
print("reserved GiB", round(torch.cuda.memory_reserved() / 2**30, 2))
