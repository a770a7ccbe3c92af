"""Host cost per call of the kit's 4-bit linear (grpo_kit.model.nf4_matmul) against a 16-bit ``nn.Linear``, on the GPU.

A 4096 x 4096 NF4 layer (bitsandbytes, fp16 compute) with the kit's matmul and an fp16 ``nn.Linear``, fed 16 rows
so the GPU work is negligible and the time per call is the host's: the dequantisation launch, a forward with grad
(outside and inside ``layer_weight_cache``), a forward + backward, a no-grad forward. Why the 1K 4-bit step is
slower than its GPU work says (bench/results/step.md: GPU kernels about equal, host ops
+2.2 s under the profiler). Needs CUDA and bitsandbytes:

    python -m grpo_kit bench nf4_host_cost
"""

import time

import torch


def per_call_us(name: str, fn, calls: int = 2000, warmup: int = 50) -> None:
    """Print ``fn``'s time per call in microseconds: host (no wait inside the loop), then with the GPU's work
    (one wait after it). Equal figures mean the call is host-bound."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / calls * 1e6
    print(f"{name}: host {host:.1f} us/call, with GPU {total:.1f}")


def main() -> None:
    import bitsandbytes as bnb

    from grpo_kit.kernels import nf4_dequant as K
    from grpo_kit.model import nf4_matmul as NM

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        bnb.nn.Linear4bit(
            4096, 4096, bias=False, compute_dtype=torch.float16, quant_type="nf4", compress_statistics=True
        )
    ).cuda()
    NM.use_nf4_matmul(model, "kit")
    kit = model[0]
    ref = torch.nn.Linear(4096, 4096, bias=False, dtype=torch.float16, device="cuda")
    qs = kit.weight.quant_state
    x = torch.randn(1, 16, 4096, dtype=torch.float16, device="cuda", requires_grad=True)

    def kit_cached_x10():
        with NM.layer_weight_cache():
            for _ in range(10):
                kit(x)

    def ref_x10():
        for _ in range(10):
            ref(x)

    def kit_forward_backward():
        with NM.layer_weight_cache():
            kit(x).sum().backward()

    per_call_us("dequantize_triton", lambda: K.dequantize_triton(kit.weight.data, qs))
    per_call_us("_dequantize", lambda: NM._dequantize(kit, torch.float16))
    per_call_us("nn.Linear fwd grad", lambda: ref(x))
    per_call_us("kit fwd grad no cache", lambda: kit(x))
    per_call_us("kit fwd grad cached x10", kit_cached_x10, 300)
    per_call_us("nn.Linear x10", ref_x10, 300)
    per_call_us("kit fwd+bwd", kit_forward_backward, 500)
    per_call_us("ref fwd+bwd", lambda: ref(x).sum().backward(), 500)
    with torch.no_grad():
        per_call_us("kit nograd no cache", lambda: kit(x))


if __name__ == "__main__":
    main()
