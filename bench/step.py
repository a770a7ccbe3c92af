"""Benchmark: one whole GRPO optimiser step on a real architecture with random weights.

Model: ``grpo_kit.model.loading.build_random_model(name)`` in bf16 on the GPU, LoRA r=16 (alpha 16,
dropout 0) on every linear layer of the decoder via peft (adapter weights fp32, peft's
default), AdamW (lr 1e-5) on the adapter. One step =

1. reference log-probs of all G generations, LoRA adapter disabled, ``torch.no_grad``,
   ``micro_batch`` sequences at a time (``--ref-micro-batch``: another number, to see what batching the
   no-grad pass would save: fewer, larger matmuls, and fewer dequantisations in 4-bit);
2. policy forward + backward over all G generations, ``micro_batch`` at a time, loss scaled
   by micro_batch / G (gradient accumulation), loss_type ``grpo``, beta, eps 0.2;
3. optimiser step, ``zero_grad(set_to_none=True)``.

Rows (same model object, same inputs, one after another in one process):

* ``baseline``     HF ``gradient_checkpointing_enable`` (non-reentrant), TRL-style loss:
                   full (B, C, V) logits of the completion -> fp32 log_softmax -> gather ->
                   ``grpo_loss_reference``; the reference pass the same way under no_grad.
* ``ours``         ``enable_offloaded_checkpointing(offload=False)`` (recompute, sequence
                   chunks) + ``efficient_grpo_loss`` / ``per_token_logps``.
* ``ours_offload`` the same with layer inputs offloaded to pinned host RAM.

Measured per row: peak ``max_memory_allocated`` and ``max_memory_reserved`` over the step,
step time (``cuda.synchronize`` + wall clock, after a short warm-up step; with ``--repeat N`` the median of
the measured steps after the first), tokens/s
(G x seq_len / step time), and a per-phase breakdown from the allocator's counters
(allocated at the start / peak / at the end of: reference pass, first micro-batch's body
forward, its loss, its backward, the other micro-batches, the optimiser step), plus host
bytes held by the offload buffers. Out-of-memory is caught and reported as such.

Longest context within a budget: not a bisection over full steps (a step of Llama-3.1-8B at
256K tokens takes minutes); the peaks measured at several lengths are fitted with
peak = a + b*T (ours: linear, attention is SDPA), the fit predicts the longest T within the
budget, and a confirmation step at a chosen length runs under
``torch.cuda.set_per_process_memory_fraction(budget)`` (an overshoot fails with OOM).

Run: ``python -m grpo_kit bench step --plan full`` (GPU) or single configs, e.g.
``python bench/step.py --model llama-3.1-8b --gens 8 --seq-len 20480 --micro-batch 1``.
CPU debug: ``python bench/step.py --device cpu --model tiny-llama --gens 4 --seq-len 64``.
Re-plot: ``python bench/step.py --replot /tmp/step_h200.json`` (a run's in-progress json, in the temp folder).
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from contextlib import nullcontext  # noqa: E402

import torch  # noqa: E402
from _common import (  # noqa: E402
    LORA_TARGETS,
    kernel_profile,
    record_report,
    sync,  # noqa: E402
)
from _common import hardware as _hardware  # noqa: E402
from _common import rel_err as rel  # noqa: E402

from grpo_kit.loss.efficient import efficient_grpo_loss, per_token_logps  # noqa: E402
from grpo_kit.loss.reference import grpo_loss_reference  # noqa: E402
from grpo_kit.memory import Profiler, phase  # noqa: E402
from grpo_kit.model import nf4_matmul  # noqa: E402
from grpo_kit.model.fp8 import BASE_WEIGHTS, fp8_lora_config  # noqa: E402
from grpo_kit.model.loading import build_random_model, model_config  # noqa: E402
from grpo_kit.model.offload import (  # noqa: E402
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    offload_stats,
    reserve_offload_buffers,
)

GiB = 2**30
ROWS = ("baseline", "ours", "ours_offload")
LOSS_KW = dict(epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo")
# Budgets for "longest context that fits" (GiB handed to set_per_process_memory_fraction):
# an 80 GB card shows ~79.2 GiB to torch, a 16 GB T4 ~14.6 GiB; take a little less for the
# CUDA context and allocator slack.
BUDGETS = {"80GB": 78.0, "15GB": 14.0}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------------
# model, modes, one step
# ------------------------------------------------------------------------------------------------
def build(
    name, device, lora_r, seed=0, layers=None, random_lora=False, dtype=None, load_in_4bit=False, base_weights="16bit"
):
    """PEFT model with LoRA on every linear layer, and the GPU bytes of its base weights. ``dtype``: None
    (bf16 on CUDA, fp32 on CPU) or a torch dtype. ``load_in_4bit``: the kit's QLoRA load
    (``grpo_kit.model.loading.load_model``: each linear layer created on ``device`` and quantised to NF4 there
    at once, lm_head 16-bit), so the GPU never holds the 16-bit model. ``base_weights="fp8"``: the kit's FP8
    load (e4m3 per-channel codes quantised on ``device`` layer by layer, W8A8 forward), LoRA on top as the
    trainer puts it."""
    import peft

    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if load_in_4bit or base_weights != "16bit":
        from grpo_kit.model.loading import load_model

        if layers is not None:
            raise ValueError("layers= is not supported with load_in_4bit or FP8 base weights")
        model, _ = load_model(
            name, dtype=dtype, device=device, seed=seed, load_in_4bit=load_in_4bit, base_weights=base_weights
        )
        model.config.use_cache = False
        q = model.grpo_kit_quantization
        progress(
            f"{name}: {q['load']}: {q.get('build_s', q.get('build_16bit_s'))} s"
            + (f" + NF4 onto {device} {q['quantize_s']} s" if "quantize_s" in q else "")
        )
    else:
        cfg = model_config(name)
        if layers is not None:
            cfg = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": layers})
        cfg.use_cache = False
        model = build_random_model(cfg, dtype=dtype, device=device, seed=seed)
    # NF4 parameters report their packed bytes; what the GPU holds (absmax constants too) is the allocator's count
    # (FP8 codes and scales are parameters of their true size)
    weights = (
        torch.cuda.memory_allocated(device)
        if load_in_4bit and device.type == "cuda"
        else sum(p.numel() * p.element_size() for p in model.parameters())
    )
    torch.manual_seed(seed + 1)
    # random_lora: lora_B not zero, so the correctness check sees non-zero lora_A gradients too
    conf = peft.LoraConfig(
        r=lora_r, lora_alpha=lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS, init_lora_weights=not random_lora
    )
    if base_weights == "fp8":
        conf = fp8_lora_config(conf)
    model = peft.get_peft_model(model, conf)
    return model, weights


def parts(model):
    """(causal-LM module, body returning hidden states, head weight (V, H))."""
    lm = model.base_model.model
    return lm, lm.model, lm.lm_head.weight


def set_row(model, row):
    lm, _, _ = parts(model)
    disable_offloaded_checkpointing(model)
    lm.gradient_checkpointing_disable()
    if getattr(lm, "_require_grads_hook", None) is not None:
        lm.disable_input_require_grads()
    if row == "baseline":
        # what TRL / HF Trainer do with gradient_checkpointing=True and a PEFT model
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif row == "ours":
        enable_offloaded_checkpointing(model, offload=False)
    elif row == "ours_offload":
        enable_offloaded_checkpointing(model, offload=True)
    elif row != "none":  # "none": no checkpointing at all (correctness check only)
        raise ValueError(f"row must be one of {ROWS}, got {row!r}")


def full_logits_logps(lm, hidden, ids):
    """TRL style: (B, C, V) logits, fp32 log_softmax, gather. hidden (B, C, H) -> (B, C) fp32."""
    logits = lm.lm_head(hidden)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def phase_rows(prof: Profiler) -> dict:
    """Per phase name of a finished :class:`grpo_kit.memory.Profiler` (bytes): allocated at the first start,
    the peak over every time it was entered, allocated at the last end."""
    rows = {}
    for ph in sorted(prof.phases, key=lambda p: p.start_s):
        prev = rows.get(ph.name)
        rows[ph.name] = dict(
            start=prev["start"] if prev else ph.start, peak=max(ph.peak, prev["peak"] if prev else 0), end=ph.end
        )
    rows.pop("total", None)
    return rows


def grpo_step(model, opt, row, batch, args, scaler=None):
    """One optimiser step (module docstring). ``scaler``: a GradScaler (fp16), or None. Its phases are marked
    with :func:`grpo_kit.memory.phase`: measured when a :class:`grpo_kit.memory.Profiler` is active."""
    lm, body, W = parts(model)
    ids, adv, mask = batch["ids"], batch["adv"], batch["mask"]
    G, P, mb = ids.shape[0], args.prompt_len, args.micro_batch
    rmb = args.ref_micro_batch or mb
    comp = ids[:, P:]
    ref = torch.empty(comp.shape, dtype=torch.float32, device=ids.device)
    with phase("ref_pass"), torch.no_grad(), model.disable_adapter():
        for s in range(0, G, rmb):
            h = body(input_ids=ids[s : s + rmb], use_cache=False).last_hidden_state[:, P - 1 : -1]
            if row == "baseline":
                ref[s : s + rmb] = full_logits_logps(lm, h, comp[s : s + rmb])
            else:
                ref[s : s + rmb] = per_token_logps(h, W, comp[s : s + rmb])
            del h
    # every line runs inside some phase: the step's peak is the max over phases
    for s in range(0, G, mb):
        first = s == 0
        sl = slice(s, s + mb)
        rest = nullcontext() if first else phase("other_microbatches")
        rest.__enter__()
        with phase("mb0_forward") if first else nullcontext():
            h = body(input_ids=ids[sl], use_cache=False).last_hidden_state[:, P - 1 : -1]
        with phase("mb0_loss") if first else nullcontext():
            if row == "baseline":
                lp = full_logits_logps(lm, h, comp[sl])
                loss, _ = grpo_loss_reference(lp, None, ref[sl], adv[sl], mask[sl], beta=args.beta, **LOSS_KW)
            else:
                loss, _ = efficient_grpo_loss(
                    h, W, comp[sl], mask[sl], adv[sl], ref_logps=ref[sl], beta=args.beta, **LOSS_KW
                )
            loss = loss * (ids[sl].shape[0] / G)
        with phase("mb0_backward") if first else nullcontext():
            (scaler.scale(loss) if scaler is not None else loss).backward()
        del h, loss
        if row == "baseline":
            del lp
        rest.__exit__(None, None, None)
    with phase("optimizer"):
        if scaler is not None:  # unscales, skips the step on inf/nan gradients, adapts the scale
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)


def progress(msg: str) -> None:
    """One timestamped line on stderr as the run goes (a run cut by its time limit still says where it was)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_batch(G, T, P, vocab, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (G, T), generator=g).to(device)
    adv = torch.randn(G, generator=g).to(device)
    mask = torch.ones(G, T - P, dtype=torch.bool, device=device)
    return dict(ids=ids, adv=adv, mask=mask)


def _index(dev):
    return dev.index if dev.index is not None else torch.cuda.current_device()


def cleanup(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def run_row(model, row, args, dev, G, T, budget_gib=None, warmup=True):
    """``args.repeat`` measured steps of ``row`` (after a short warm-up step). Returns a result dict."""
    res = dict(
        row=row,
        model=args.model,
        gens=G,
        seq_len=T,
        prompt_len=args.prompt_len,
        completion_len=T - args.prompt_len,
        micro_batch=args.micro_batch,
        ref_micro_batch=args.ref_micro_batch or args.micro_batch,
        beta=args.beta,
        budget_gib=budget_gib,
    )
    opt = None
    try:
        set_row(model, row)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        # fp16 (a T4 has no bf16): HF Trainer's GradScaler, as the kit's trainer runs it
        scaler = torch.amp.GradScaler(dev.type) if parts(model)[2].dtype == torch.float16 else None
        vocab = parts(model)[2].shape[0]
        if warmup:  # kernels, cuBLAS handles, Triton compiles, AdamW state allocation
            t0 = time.perf_counter()
            wb = make_batch(min(G, args.micro_batch), min(T, args.prompt_len + 256), args.prompt_len, vocab, dev, 1)
            grpo_step(model, opt, row, wb, args, scaler)
            del wb
            progress(f"{row} {G} x {T}: warm-up step {time.perf_counter() - t0:.1f} s")
        batch = make_batch(G, T, args.prompt_len, vocab, dev, 2)
        if row == "ours_offload":
            # page-lock the host buffers once, outside the timed step (as a training run would
            # before its first step); the one-off cost is reported separately
            t0 = time.perf_counter()
            res["host_buffers_reserved_gib"] = reserve_offload_buffers(model, min(G, args.micro_batch), T) / GiB
            res["host_buffer_setup_s"] = time.perf_counter() - t0
        cleanup(dev)
        if budget_gib is not None and dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gib * GiB / total), _index(dev))
        prof = Profiler(device=str(dev)) if dev.type == "cuda" else None  # the CPU runs time only
        times = []
        nf4_matmul.reset_stats()
        with prof if prof is not None else nullcontext():
            for _ in range(args.repeat):
                sync(dev)
                t0 = time.perf_counter()
                grpo_step(model, opt, row, batch, args, scaler)
                sync(dev)
                times.append(time.perf_counter() - t0)
                progress(f"{row} {G} x {T}: step {len(times)} of {args.repeat}: {times[-1]:.2f} s")
        res["dequantized_per_step"] = nf4_matmul.reset_stats()["dequantized"] / args.repeat  # the kit's matmul
        if args.kernel_profile and dev.type == "cuda":
            res["kernel_profile"] = kernel_profile(
                functools.partial(grpo_step, model, opt, row, batch, args, scaler),
                dev,
                match={"dequant_cuda_ms": "dequant"},
            )
        # with repeats, the median of the steps after the first (which autotunes kernels for this shape)
        dt = statistics.median(times[1:] or times)
        res.update(
            status="ok",
            step_s=dt,
            step_s_all=times,
            tokens_per_s=G * T / dt,
            dtype=str(parts(model)[2].dtype).removeprefix("torch."),
        )
        if scaler is not None:
            res["grad_scale"] = scaler.get_scale()
        if dev.type == "cuda":
            total = next(ph for ph in prof.phases if ph.name == "total")
            res.update(
                peak_allocated_gib=total.peak / GiB,
                peak_reserved_gib=total.peak_reserved / GiB,
                phases={k: {kk: vv / GiB for kk, vv in v.items()} for k, v in phase_rows(prof).items()},
            )
        res["host_offload_gib"] = offload_stats(model)["host_bytes"] / GiB
        res["host_pinned_gib"] = offload_stats(model)["pinned_bytes"] / GiB
    except torch.OutOfMemoryError as e:
        res.update(status="oom", error=str(e).splitlines()[0][:300])
        if dev.type == "cuda":
            res["peak_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / GiB
    finally:
        if dev.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, _index(dev))
        model.zero_grad(set_to_none=True)
        del opt
        disable_offloaded_checkpointing(model)  # frees the host buffers
        cleanup(dev)
    print(json.dumps({k: v for k, v in res.items() if k != "phases"}), flush=True)
    return res


# ------------------------------------------------------------------------------------------------
# GPU correctness check: offload vs no offload vs HF checkpointing, gradients on CUDA
# ------------------------------------------------------------------------------------------------
def lora_grads(model, row, batch, P):
    set_row(model, row)
    lm, body, W = parts(model)
    model.zero_grad(set_to_none=True)
    ids, adv, mask = batch["ids"], batch["adv"], batch["mask"]
    for s in range(ids.shape[0]):  # 2 micro-batches of 1: gradient accumulation
        h = body(input_ids=ids[s : s + 1], use_cache=False).last_hidden_state[:, P - 1 : -1]
        loss, _ = efficient_grpo_loss(h, W, ids[s : s + 1, P:], mask[s : s + 1], adv[s : s + 1], **LOSS_KW)
        (loss / ids.shape[0]).backward()
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    disable_offloaded_checkpointing(model)
    return g


def gpu_check(args, dev):
    out = {}
    # copies: pinned (cudaHostRegister) buffers, 1 GiB each way
    from grpo_kit.model.offload import _HostBuffer

    side = torch.cuda.Stream(dev)
    hb = _HostBuffer(GiB, True, side)
    x = torch.randn(GiB // 2, dtype=torch.bfloat16, device=dev)
    view = hb.view(x.shape, x.dtype)
    for name, dst, src in (("d2h", view, x), ("h2d", x, view)):
        fn = functools.partial(dst.copy_, src, non_blocking=True)
        fn()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        sync(dev)
        out[f"{name}_GBps"] = 3 * GiB / (time.perf_counter() - t0) / 1e9
    out["host_buffer_pinned"] = hb.pinned
    out["host_buffer_registered"] = hb._registered
    del hb, x, view, fn
    for dtype_name, layers, T in (("float32", 2, 1536), ("bfloat16", None, 4096)):
        torch.backends.cuda.matmul.allow_tf32 = False
        model, _ = build(args.check_model, dev, args.lora_r, layers=layers, random_lora=True)
        if dtype_name == "float32":
            model = model.float()
        vocab = parts(model)[2].shape[0]
        batch = make_batch(2, T, 256, vocab, dev, 5)
        g_none = lora_grads(model, "none", batch, 256) if layers else None
        g_hf = lora_grads(model, "baseline", batch, 256)
        g_ours = lora_grads(model, "ours", batch, 256)
        g_off = lora_grads(model, "ours_offload", batch, 256)
        # run-to-run spread of the same path: the noise floor the other differences are read against
        g_ours2 = lora_grads(model, "ours", batch, 256)
        g_hf2 = lora_grads(model, "baseline", batch, 256)
        r = dict(
            model=args.check_model,
            layers=layers or "all",
            seq_len=T,
            gens=2,
            offload_vs_ours_bitwise_equal=all(torch.equal(g_ours[n], g_off[n]) for n in g_ours),
            offload_vs_ours_max_rel=max(rel(g_off[n], g_ours[n]) for n in g_ours),
            ours_vs_ours_rerun_bitwise_equal=all(torch.equal(g_ours[n], g_ours2[n]) for n in g_ours),
            ours_vs_ours_rerun_max_rel=max(rel(g_ours2[n], g_ours[n]) for n in g_ours),
            hf_vs_hf_rerun_max_rel=max(rel(g_hf2[n], g_hf[n]) for n in g_hf),
            ours_vs_hf_max_rel=max(rel(g_ours[n], g_hf[n]) for n in g_ours),
            ours_vs_hf_median_rel=sorted(rel(g_ours[n], g_hf[n]) for n in g_ours)[len(g_ours) // 2],
            n_params=len(g_ours),
        )
        if g_none is not None:
            r["hf_vs_none_max_rel"] = max(rel(g_hf[n], g_none[n]) for n in g_hf)
            r["ours_vs_none_max_rel"] = max(rel(g_ours[n], g_none[n]) for n in g_ours)
        out[f"parity_{dtype_name}"] = r
        print(json.dumps(r), flush=True)
        del model
        cleanup(dev)
    return out


# ------------------------------------------------------------------------------------------------
# plans: sets of configs run in one process
# ------------------------------------------------------------------------------------------------
def fit_max_len(points, budget_gib):
    """Least-squares peak = a + b*T over (T, peak GiB); longest T with peak <= budget (or None)."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(p for _, p in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    if sxx == 0:
        return None
    b = sum((t - mx) * (p - my) for t, p in points) / sxx
    a = my - b * mx
    if b <= 0:
        return None
    return dict(a_gib=a, b_gib_per_token=b, t_max=int((budget_gib - a) / b), budget_gib=budget_gib)


PLANS = {
    # GPU smoke: correctness on CUDA + one small step of each row
    "smoke": [
        dict(kind="check"),
        dict(model="llama-3.2-1b", gens=8, seq_len=2048, micro_batch=1, rows=ROWS),
        dict(model="llama-3.2-1b", gens=1, seq_len=32768, micro_batch=1, rows=("ours", "ours_offload")),
    ],
    # headline table + calibration points for the memory calculator
    "full": [
        dict(model="qwen2.5-1.5b", gens=8, seq_len=1024, micro_batch=8, rows=ROWS, tag="headline_qwen"),
        dict(model="qwen2.5-1.5b", gens=1, seq_len=4096, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"),
        dict(model="qwen2.5-1.5b", gens=1, seq_len=8192, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"),
        dict(
            model="qwen2.5-1.5b", gens=1, seq_len=16384, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"
        ),
        dict(model="qwen2.5-1.5b", gens=1, seq_len=65536, micro_batch=1, rows=("ours_offload",), tag="long"),
        dict(
            model="llama-3.1-8b",
            gens=8,
            seq_len=20480,
            micro_batch=1,
            rows=("ours_offload", "ours", "baseline"),
            tag="headline_8b",
        ),
        dict(model="llama-3.1-8b", gens=1, seq_len=4096, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"),
        dict(model="llama-3.1-8b", gens=1, seq_len=8192, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"),
        dict(
            model="llama-3.1-8b",
            gens=1,
            seq_len=16384,
            micro_batch=1,
            rows=("baseline", "ours_offload", "ours"),
            tag="calib",
        ),
        dict(model="llama-3.1-8b", gens=1, seq_len=65536, micro_batch=1, rows=("ours_offload",), tag="long"),
        dict(model="llama-3.1-8b", gens=1, seq_len=131072, micro_batch=1, rows=("ours_offload",), tag="long"),
    ],
    # the same without the slow long-context points and the 8K calibration points
    "core": [
        dict(model="qwen2.5-1.5b", gens=8, seq_len=1024, micro_batch=8, rows=ROWS, tag="headline_qwen"),
        dict(model="qwen2.5-1.5b", gens=1, seq_len=4096, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"),
        dict(
            model="qwen2.5-1.5b", gens=1, seq_len=16384, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"
        ),
        dict(model="qwen2.5-1.5b", gens=1, seq_len=65536, micro_batch=1, rows=("ours_offload",), tag="long"),
        dict(
            model="llama-3.1-8b",
            gens=8,
            seq_len=20480,
            micro_batch=1,
            rows=("ours_offload", "ours", "baseline"),
            tag="headline_8b",
        ),
        dict(model="llama-3.1-8b", gens=1, seq_len=4096, micro_batch=1, rows=("baseline", "ours_offload"), tag="calib"),
        dict(
            model="llama-3.1-8b",
            gens=1,
            seq_len=16384,
            micro_batch=1,
            rows=("baseline", "ours_offload", "ours"),
            tag="calib",
        ),
        dict(model="llama-3.1-8b", gens=1, seq_len=65536, micro_batch=1, rows=("ours_offload",), tag="long"),
    ],
    # long context: confirmation under an 80 GB budget (minutes per step)
    "long": [
        dict(model="llama-3.1-8b", gens=1, seq_len=131072, micro_batch=1, rows=("ours_offload",), tag="long"),
        dict(
            model="llama-3.1-8b",
            gens=1,
            seq_len=262144,
            micro_batch=1,
            rows=("ours_offload",),
            tag="confirm",
            budget="80GB",
        ),
        dict(model="llama-3.1-8b", gens=1, seq_len=131072, micro_batch=1, rows=("ours",), tag="long"),
    ],
}


def hardware(dev):
    """``_common.hardware`` plus this report's names for the host and the GPU."""
    h = _hardware(dev)
    h.update(host=platform.node(), cpu_count=h["cores"])
    return h


def run_plan(configs, args, dev, sink):
    models = {}
    for cfg in configs:
        if cfg.get("kind") == "check":
            sink["check"] = gpu_check(args, dev)
            sink.flush()
            continue
        name = cfg["model"]
        if name not in models:
            for old in list(models):  # one model on the GPU at a time
                del models[old]
            cleanup(dev)
            t0 = time.perf_counter()
            m, w = build(
                name,
                dev,
                args.lora_r,
                dtype=DTYPES[args.dtype] if dev.type == "cuda" else None,
                load_in_4bit=args.load_in_4bit,
                base_weights=args.base_weights,
            )
            models[name] = m
            sink["weights_gib"][name] = w / GiB
            built = sink.setdefault("build_s", {})[name] = time.perf_counter() - t0
            progress(
                f"built {name} ({'NF4, ' if args.load_in_4bit else ''}{str(parts(m)[2].dtype).removeprefix('torch.')})"
                f" in {built:.1f} s"
            )
        args.model, args.micro_batch = name, cfg["micro_batch"]
        budget = cfg.get("budget")
        budget_gib = cfg.get("budget_gib") or (BUDGETS[budget] if budget else None)
        for row, impl in [
            (row, impl) for row in cfg["rows"] for impl in (args.nf4_matmul if args.load_in_4bit else [None])
        ]:
            if impl is not None:  # the same model in the same process: only how its 4-bit layers multiply differs
                nf4_matmul.use_nf4_matmul(models[name], impl)
            r = run_row(models[name], row, args, dev, cfg["gens"], cfg["seq_len"], budget_gib=budget_gib)
            r["load_in_4bit"], r["nf4_matmul"], r["base_weights"] = args.load_in_4bit, impl, args.base_weights
            r["tag"] = cfg.get("tag", "")
            r["weights_gib"] = sink["weights_gib"][name]
            r["budget_name"] = budget
            sink["results"].append(r)
            sink.flush()
        if args.until_ok and sink["results"] and sink["results"][-1].get("status") == "ok":
            return  # a descending list of lengths: the first that runs is the longest that does


class Sink(dict):
    """The results json, rewritten after every row (partial results survive a timeout)."""

    def __init__(self, path, **kw):
        super().__init__(**kw)
        self.path = path

    def flush(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self, indent=1, default=str))


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def derive(data):
    """Fits for the longest context, offload overhead, calibration points (added to the json)."""
    res = [r for r in data["results"] if r.get("status") == "ok"]
    out = {}
    for model in sorted({r["model"] for r in res}):
        for row in ROWS:
            pts = sorted(
                {
                    (r["seq_len"], r["peak_allocated_gib"])
                    for r in res
                    if r["model"] == model
                    and r["row"] == row
                    and r["gens"] == 1
                    and r["micro_batch"] == 1
                    and "peak_allocated_gib" in r
                    and r.get("budget_gib") is None
                }
            )
            if len(pts) >= 2:
                out.setdefault("fit_max_context", []).append(
                    dict(model=model, row=row, points=pts, **{k: fit_max_len(pts, b) for k, b in BUDGETS.items()})
                )
    over = []
    for r in res:
        if r["row"] != "ours_offload":
            continue
        twin = [
            q
            for q in res
            if q["row"] == "ours"
            and all(
                q.get(k) == r.get(k)
                for k in ("model", "gens", "seq_len", "micro_batch", "ref_micro_batch", "nf4_matmul")
            )
        ]
        if twin:
            over.append(
                dict(
                    model=r["model"],
                    gens=r["gens"],
                    seq_len=r["seq_len"],
                    micro_batch=r["micro_batch"],
                    ours_s=twin[0]["step_s"],
                    offload_s=r["step_s"],
                    overhead_pct=100 * (r["step_s"] / twin[0]["step_s"] - 1),
                )
            )
    out["offload_overhead"] = over
    out["calibration_for_memory_calculator"] = [
        {
            k: r.get(k)
            for k in (
                "model",
                "row",
                "gens",
                "micro_batch",
                "ref_micro_batch",
                "seq_len",
                "prompt_len",
                "completion_len",
                "beta",
                "load_in_4bit",
                "nf4_matmul",
                "peak_allocated_gib",
                "peak_reserved_gib",
                "weights_gib",
                "host_offload_gib",
            )
        }
        for r in res
        if r["row"] in ("baseline", "ours_offload") and "peak_allocated_gib" in r
    ]
    return out


def fmt(v, nd=1):
    return "—" if v is None else f"{v:.{nd}f}"


def write_report(data, out_dir, tag, record=True):
    """The run's summary (printed) and phase plot (beside the in-progress json); with ``record``, its rows
    appended to ``out_dir``'s data file (``data/step.jsonl``). Returns the summary's text."""
    data["derived"] = derive(data)
    jpath = data.path if isinstance(data, Sink) else None
    fp8 = data.get("args", {}).get("base_weights") == "fp8"
    hw = data["hardware"]
    L = [
        f"# Whole GRPO step benchmark ({hw.get('gpu', 'cpu')})",
        "",
        f"Command: `{data['command']}`  ",
        f"Date: {hw['date']}; torch {hw['torch']}, triton {hw.get('triton')}, "
        f"transformers {hw.get('transformers')}, peft {hw.get('peft')}; GPU {hw.get('gpu')} "
        f"({fmt(hw.get('gpu_total_gib'))} GiB); host RAM {fmt(hw.get('host_ram_gib'))} GiB.",
        "",
        f"Random {data['results'][0].get('dtype', 'bf16') if data['results'] else 'bf16'} weights"
        f"{' (linear layers NF4)' if data.get('args', {}).get('load_in_4bit') else ''}"
        f"{' (linear layers FP8 e4m3, per-channel scales)' if fp8 else ''}"
        ", LoRA on all linear layers "
        "(fp32 adapter), AdamW; one step = reference log-probs (adapter off, no grad) + policy forward/backward "
        "over all generations in micro-batches + optimiser step. Peaks are `torch.cuda.max_memory_allocated` / "
        "`max_memory_reserved` over the measured step; time: "
        + (
            f"the median of the timed steps after the first of {data['args']['repeat']} "
            if data.get("args", {}).get("repeat", 1) > 1
            else "one step "
        )
        + "after a short warm-up step. Loss: grpo, eps 0.2, beta as listed. "
        "Every sequence is full length (no padding).",
        "",
        "| model | G x seq (prompt) | micro-batch | row | status | peak alloc GiB | peak reserved GiB | step s | tokens/s | host offload GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        ref_mb = r.get("ref_micro_batch", r["micro_batch"])
        L.append(
            f"| {r['model']} | {r['gens']} x {r['seq_len']} ({r['prompt_len']}) | {r['micro_batch']}"
            + (f" (reference pass {ref_mb})" if ref_mb != r["micro_batch"] else "")
            + f" | {r['row']}"
            + (
                f" (4-bit, {r['nf4_matmul']} matmul"
                + (f", {r['dequantized_per_step']:.0f} dequant./step" if r.get("dequantized_per_step") else "")
                + ")"
                if r.get("nf4_matmul")
                else ""
            )
            + f"{' (budget ' + fmt(r['budget_gib']) + ' GiB)' if r.get('budget_gib') else ''} | {r['status']} | "
            f"{fmt(r.get('peak_allocated_gib'), 2)} | {fmt(r.get('peak_reserved_gib'), 2)} | "
            f"{fmt(r.get('step_s'), 2)} | {fmt(r.get('tokens_per_s'), 0)} | {fmt(r.get('host_offload_gib'), 2)} |"
        )
    for r in data["results"]:
        kp = r.get("kernel_profile")
        if kp:
            L += [
                "",
                f"Profiled step ({r['model']}, {r['gens']} x {r['seq_len']}, {r['row']}"
                f"{', 4-bit ' + r['nf4_matmul'] + ' matmul' if r.get('nf4_matmul') else ''}): wall "
                f"{kp['wall_s_profiled']:.2f} s under the profiler, GPU kernels {kp['cuda_total_ms'] / 1e3:.2f} s "
                f"busy, of which dequantisation {kp['dequant_cuda_ms'] / 1e3:.2f} s; host ops "
                f"{kp['cpu_total_ms'] / 1e3:.2f} s. Top GPU ops: "
                + "; ".join(f"{e['name']} {e['self_cuda_ms']:.0f} ms ({e['calls']})" for e in kp["top_cuda"][:6])
                + ".",
            ]
    d = data["derived"]
    if d.get("offload_overhead"):
        L += [
            "",
            "Offload cost (same config, ours_offload vs ours):",
            "",
            "| model | G x seq | micro-batch | ours s | ours_offload s | overhead |",
            "|---|---|---|---|---|---|",
        ]
        for o in d["offload_overhead"]:
            L.append(
                f"| {o['model']} | {o['gens']} x {o['seq_len']} | {o['micro_batch']} | {o['ours_s']:.2f} | "
                f"{o['offload_s']:.2f} | {o['overhead_pct']:+.1f}% |"
            )
    if d.get("fit_max_context"):
        L += [
            "",
            "Longest single sequence within a budget: linear fit peak = a + b*T over the measured one-sequence "
            "peaks above (not a bisection); budgets 80GB -> "
            + fmt(BUDGETS["80GB"])
            + " GiB, 15GB -> "
            + fmt(BUDGETS["15GB"])
            + " GiB. Confirmation runs, if any, are the rows with a budget.",
            "",
            "| model | row | points (T, GiB) | a GiB | b KiB/token | T max (80GB) | T max (15GB) |",
            "|---|---|---|---|---|---|---|",
        ]
        for f in d["fit_max_context"]:
            f80, f15 = f["80GB"], f["15GB"]
            pts = ", ".join(f"({t}, {p:.1f})" for t, p in f["points"])
            L.append(
                f"| {f['model']} | {f['row']} | {pts} | {fmt(f80 and f80['a_gib'], 2)} | "
                f"{fmt(f80 and f80['b_gib_per_token'] * 2**20, 1)} | {f80['t_max'] if f80 else '—'} | "
                f"{(f15['t_max'] if f15['t_max'] > 0 else 'weights alone exceed it') if f15 else '—'} |"
            )
    if data.get("check"):
        L += [
            "",
            "CUDA correctness check (LoRA gradients, 2 micro-batches):",
            "",
            "```",
            json.dumps(data["check"], indent=1),
            "```",
        ]
    png = Path(tempfile.gettempdir()) / f"step_{tag}_phases.png"
    try:
        plot(data, png)  # only for configs compared across rows (or >= 64K)
    except Exception as e:  # noqa: BLE001 - the plot is optional, the numbers are not
        print(f"plot failed: {type(e).__name__}: {e}")
    L += [
        "",
        "Per-phase allocator counters (GiB: allocated at start / peak / at end) of each measured step are in the "
        "data file"
        + (f"; plot: `{png}`." if png.exists() else ".")
        + (f" In-progress json: `{jpath}`." if jpath else ""),
    ]
    if not record:
        print("\n".join(L))
        return "\n".join(L)
    return record_report("step", dict(data), L, out_dir)


def plot(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in data["results"] if r.get("phases")]
    groups = {}
    for r in res:
        groups.setdefault((r["model"], r["gens"], r["seq_len"], r["micro_batch"]), []).append(r)
    groups = {k: v for k, v in groups.items() if len(v) >= 2 or k[2] >= 65536}
    if not groups:
        return
    order = ["ref_pass", "mb0_forward", "mb0_loss", "mb0_backward", "other_microbatches", "optimizer"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, (key, rows) in zip(axes[0], groups.items()):
        width = 0.8 / len(rows)
        colors = {"baseline": "tab:blue", "ours": "tab:orange", "ours_offload": "tab:green"}
        for i, r in enumerate(rows):
            ph = [p for p in order if p in r["phases"]]
            xs = [order.index(p) + i * width for p in ph]  # fixed slot per phase, even if one is missing
            ax.bar(
                xs, [r["phases"][p]["peak"] for p in ph], width, label=f"{r['row']} peak", color=colors.get(r["row"])
            )
            ax.scatter(xs, [r["phases"][p]["end"] for p in ph], marker="_", s=200, color="k", zorder=3)
        ax.axhline(r["weights_gib"], ls="--", color="grey", lw=1, label="bf16 weights")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(order))])
        ax.set_xticklabels([p.replace("_", "\n") for p in order], fontsize=7)
        ax.set_title(f"{key[0]}: {key[1]} x {key[2]}, micro-batch {key[3]}", fontsize=9)
        ax.set_ylabel("GiB (bar: peak in phase; tick: allocated at end)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", choices=sorted(PLANS), help="a predefined set of configs (GPU)")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--gens", type=int, default=8, help="generations per step (G)")
    p.add_argument(
        "--seq-len",
        default="20480",
        help="tokens per sequence, prompt included; a comma list runs "
        "one config per length on the same model, each `T` or `T:G` (G generations instead of --gens)",
    )
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument(
        "--ref-micro-batch",
        type=int,
        default=None,
        help="sequences per no-grad reference forward (default: --micro-batch)",
    )
    p.add_argument("--budget", choices=sorted(BUDGETS), help="run under this memory budget (fraction cap)")
    p.add_argument("--budget-gib", type=float, help="run under this many GiB (fraction cap); overrides --budget")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="weights and activations on CUDA (fp16: with a GradScaler, as on a T4)",
    )
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA: the base linear weights in NF4 (bitsandbytes)")
    p.add_argument(
        "--base-weights",
        choices=BASE_WEIGHTS,
        default="16bit",
        help="fp8: the base linear weights as "
        "FP8 e4m3 codes with per-channel scales (grpo_kit.model.fp8; CUDA with compute capability >= 8.9)",
    )
    p.add_argument(
        "--nf4-matmul",
        default="kit",
        help="with --load-in-4bit (ignored without): how the 4-bit layers "
        "multiply, a comma list run one after the other on the same model (kit, bitsandbytes: "
        "grpo_kit.model.nf4_matmul)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed steps per row at the measured shape; with more "
        "than one, step_s is the median of those after the first (peak memory: over all)",
    )
    p.add_argument(
        "--kernel-profile",
        action="store_true",
        help="after the timed steps, one more under "
        "torch.profiler: top ops by GPU and host time, dequantisation's share (in the json)",
    )
    p.add_argument(
        "--until-ok",
        action="store_true",
        help="stop after the first --seq-len that runs (status ok): "
        "with lengths in descending order, the longest that fits (e.g. under --budget-gib)",
    )
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--check-model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--tag", default=None, help="file tag (default: gpu name, e.g. h200)")
    p.add_argument(
        "--replot", help="re-print the summary and re-draw the png from a run's in-progress json (records nothing)"
    )
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: at least 1 timed step")

    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        tag = Path(args.replot).stem.removeprefix("step_")
        write_report(data, Path(args.replot).parent, tag, record=False)
        return 0
    try:
        seq_lens = [
            (int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else args.gens)
            for x in str(args.seq_len).split(",")
        ]
    except ValueError:
        raise ValueError(f"--seq-len must be T or T:G items separated by commas, got {args.seq_len!r}") from None
    for name in ("gens", "micro_batch", "lora_r") + (("ref_micro_batch",) if args.ref_micro_batch is not None else ()):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(G < 1 for _, G in seq_lens):
        raise ValueError(f"--seq-len: generations must be >= 1, got {args.seq_len!r}")
    for T, _ in seq_lens:
        if not 1 <= args.prompt_len < T:
            raise ValueError(f"--prompt-len must be in [1, seq_len), got {args.prompt_len} (seq_len {T})")
    args.nf4_matmul = list(dict.fromkeys(m for m in args.nf4_matmul.split(",") if m))
    if not args.nf4_matmul or any(m not in nf4_matmul.NF4_MATMULS for m in args.nf4_matmul):
        raise ValueError(f"--nf4-matmul: a comma list of {', '.join(nf4_matmul.NF4_MATMULS)}, got {args.nf4_matmul!r}")
    rows = tuple(r for r in args.rows.split(",") if r)
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise ValueError(f"--rows: unknown {bad}; allowed: {', '.join(ROWS)}")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu for a debug run")
    torch.backends.cuda.matmul.allow_tf32 = True
    hw = hardware(dev)
    tag = args.tag or (hw.get("gpu", "cpu").lower().replace("nvidia ", "").split()[0] if dev.type == "cuda" else "cpu")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sink = Sink(
        Path(tempfile.gettempdir()) / f"step_{tag}.json",
        command="python bench/step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        hardware=hw,
        args={"repeat": args.repeat, "load_in_4bit": args.load_in_4bit, "base_weights": args.base_weights},
        results=[],
        weights_gib={},
    )
    if args.plan:
        configs = PLANS[args.plan]
    else:
        configs = [
            dict(
                model=args.model,
                gens=G,
                seq_len=T,
                micro_batch=args.micro_batch,
                rows=rows,
                budget=args.budget,
                budget_gib=args.budget_gib,
            )
            for T, G in seq_lens
        ]
    try:
        run_plan(configs, args, dev, sink)
    except Exception:  # noqa: BLE001 - keep what was measured, then fail loudly
        traceback.print_exc()
        sink["error"] = traceback.format_exc()[-2000:]
        write_report(sink, out_dir, tag)
        return 1
    write_report(sink, out_dir, tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
