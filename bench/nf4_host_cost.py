"""Host cost per call of the kit's 4-bit linear (grpo_kit.nf4_matmul) against a 16-bit ``nn.Linear``, on the GPU.

A 4096 x 4096 NF4 layer (bitsandbytes, fp16 compute) with the kit's matmul and an fp16 ``nn.Linear``, fed 16 rows
so the GPU work is negligible and the time per call is the host's: the dequantisation launch, a forward with grad
(outside and inside ``layer_weight_cache``), a forward + backward, a no-grad forward. Why the 1K 4-bit step is
slower than its GPU work says (bench/results/step_h100_llama8b_4bit_fp16_1k.md: GPU kernels about equal, host ops
+2.2 s under the profiler). Needs CUDA and bitsandbytes:
    PYTHONPATH=$PWD python bench/nf4_host_cost.py
"""
import time, torch, bitsandbytes as bnb
from grpo_kit import nf4_matmul as NM
from grpo_kit.kernels import nf4_dequant as K
torch.manual_seed(0)
m = torch.nn.Sequential(bnb.nn.Linear4bit(4096, 4096, bias=False, compute_dtype=torch.float16, quant_type="nf4",
                                          compress_statistics=True)).cuda()
NM.use_nf4_matmul(m, "kit"); lin = m[0]
ref = torch.nn.Linear(4096, 4096, bias=False, dtype=torch.float16, device="cuda")
p = lin.weight; qs = p.quant_state
x = torch.randn(1, 16, 4096, dtype=torch.float16, device="cuda", requires_grad=True)
def t(name, f, n=2000):
    for _ in range(50): f()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): f()
    host = (time.perf_counter() - s) / n * 1e6
    torch.cuda.synchronize(); tot = (time.perf_counter() - s) / n * 1e6
    print(f"{name}: host {host:.1f} us/call, with GPU {tot:.1f}")
t("dequantize_triton", lambda: K.dequantize_triton(p.data, qs))
t("_dequantize", lambda: NM._dequantize(lin, torch.float16))
t("nn.Linear fwd grad", lambda: ref(x))
t("kit fwd grad no cache", lambda: lin(x))
def cached():
    with NM.layer_weight_cache():
        for _ in range(10): lin(x)
t("kit fwd grad cached x10", cached, 300)
def refx10():
    for _ in range(10): ref(x)
t("nn.Linear x10", refx10, 300)
def fb_kit():
    with NM.layer_weight_cache():
        lin(x).sum().backward()
def fb_ref():
    ref(x).sum().backward()
t("kit fwd+bwd", fb_kit, 500); t("ref fwd+bwd", fb_ref, 500)
with torch.no_grad():
    t("kit nograd no cache", lambda: lin(x)); 
