"""Benchmark: GRPO loss from final hidden states, forward + backward w.r.t. hidden.

Five implementations side by side in one run, same inputs (B sequences of T completion tokens,
bf16 hidden states and head weight, old/ref log-probs, beta=0.04, loss_type grpo, temperature 1):

* ``naive``   TRL style: full (B, T, V) logits, fp32 log_softmax, GRPO terms (grpo_loss_reference)
* ``liger``   Liger-Kernel ``LigerFusedLinearGRPOLoss`` (compiled=False; its own GRPO terms)
* ``cce``     Cut Cross-Entropy ``linear_cross_entropy(reduction="none")`` = -logp, GRPO terms on top
* ``unsloth`` unsloth-zoo ``fused_linear_logprobs`` (logp with in-forward gradient), GRPO terms on top
* ``trl``     TRL 1.16's ``trl.kernels.ChunkedLogProbFunction`` (logp with chunked gradient), GRPO terms on top
* ``ours``    ``grpo_kit.loss.efficient.efficient_grpo_loss`` (Triton epilogue on CUDA); ``ours_torch`` the
  same with the torch epilogue; ``ours_gspo`` / ``ours_cispo`` ours with
  ``importance_sampling_level="sequence"`` (tokens coupled: coefficients after the chunk loop) /
  ``loss_type="cispo"`` (epsilon_high 5), compared with ``ours`` on time and memory only

Reported per (head, T, impl): median time of ``--reps`` after ``--warmup`` (CUDA events), extra
peak memory over the inputs (max_memory_allocated minus the allocation once inputs exist; the
hidden-state gradient counts), time over the bf16 matmul floor 4*B*T*H*V / rate (rate measured
in this run), and the relative error of loss and grad vs ours at the first size.

Run: ``python -m grpo_kit bench loss`` or ``python bench/loss.py --out-dir bench/results``.
CPU debug: ``python bench/loss.py --tiny --device cpu --out-dir /tmp/loss_bench``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
from _common import (  # noqa: E402
    record_report,  # noqa: E402
    rel_err,
    sync,
)
from _common import timed_ms as timed  # noqa: E402

from grpo_kit.loss.efficient import efficient_grpo_loss, per_token_logps  # noqa: E402
from grpo_kit.loss.reference import grpo_loss_reference  # noqa: E402

HEADS = {"llama": (4096, 128256), "qwen": (1536, 151936)}  # name: (H, V)
TINY_HEADS = {"llama": (64, 1000), "qwen": (48, 1201)}
LOSS_KW = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo")
VARIANT_KW = {
    "ours_gspo": dict(LOSS_KW, importance_sampling_level="sequence"),
    "ours_cispo": dict(LOSS_KW, loss_type="cispo", epsilon_high=5.0),
}  # other objectives: no rel. error
GiB = 2**30


# ------------------------------------------------------------------------------------------------
# peers (imported lazily; a failure becomes the reason shown in the table)
# ------------------------------------------------------------------------------------------------
def load_peers(names):
    peers, reasons = {}, {}
    if "liger" in names:
        try:
            import liger_kernel
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            peers["liger"] = (LigerFusedLinearGRPOLoss, getattr(liger_kernel, "__version__", "?"))
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            reasons["liger"] = f"import failed: {type(e).__name__}: {e}"
    if "cce" in names:
        try:
            import cut_cross_entropy
            from cut_cross_entropy import linear_cross_entropy

            peers["cce"] = (linear_cross_entropy, cut_cross_entropy.__version__)
        except Exception as e:  # noqa: BLE001
            reasons["cce"] = f"import failed: {type(e).__name__}: {e}"
    if "trl" in names:
        try:
            import trl
            from trl.kernels import ChunkedLogProbFunction
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

            peers["trl"] = ((ChunkedLogProbFunction, _CHUNKED_LOGPROB_CHUNK_SIZE), trl.__version__)
        except Exception as e:  # noqa: BLE001
            reasons["trl"] = f"import failed: {type(e).__name__}: {e}"
    if "unsloth" in names:
        try:
            # unsloth_zoo refuses to import without UNSLOTH_IS_PRESENT=1 and an importable `unsloth`;
            # the bench alone supplies an empty stand-in package (nothing of Unsloth's is used).
            os.environ.setdefault("UNSLOTH_IS_PRESENT", "1")
            import importlib.util

            if importlib.util.find_spec("unsloth") is None:  # an empty module with a spec: find_spec finds it
                import importlib.machinery
                import types

                stub = types.ModuleType("unsloth")
                stub.__spec__ = importlib.machinery.ModuleSpec("unsloth", None)
                sys.modules["unsloth"] = stub
            import unsloth_zoo
            from unsloth_zoo.fused_losses.fused_linear import fused_linear_logprobs

            peers["unsloth"] = (fused_linear_logprobs, unsloth_zoo.__version__)
        except Exception as e:  # noqa: BLE001
            reasons["unsloth"] = f"import failed: {type(e).__name__}: {e}"
    return peers, reasons


# ------------------------------------------------------------------------------------------------
# one forward + backward per implementation; each returns (loss, ) and leaves hidden.grad set
# ------------------------------------------------------------------------------------------------
def make_runner(name, peers, inp, chunk_size=None):
    """``chunk_size``: rows per chunk for ours/ours_torch (None: the loss's automatic choice)."""
    h, W, ids, mask, adv, old, ref = (inp[k] for k in ("hidden", "W", "ids", "mask", "adv", "old", "ref"))

    def grpo_on_logps(logp):
        return grpo_loss_reference(logp, old, ref, adv, mask, **LOSS_KW)[0]

    if name == "naive":

        def run():
            logits = h @ W.t()  # (B, T, V) in bf16, as the model's lm_head would return
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            loss = grpo_on_logps(logp)
            loss.backward()
            return loss
    elif name in ("ours", "ours_torch", *VARIANT_KW):
        epi = "torch" if name == "ours_torch" else "auto"
        kw = VARIANT_KW.get(name, LOSS_KW)
        if kw["loss_type"] == "cispo":  # normalised by the active tokens, as dapo
            kw = dict(kw, num_items_in_batch=int(mask.sum()))

        def run():
            loss, _ = efficient_grpo_loss(
                h, W, ids, mask, adv, old_logps=old, ref_logps=ref, epilogue=epi, chunk_size=chunk_size, **kw
            )
            loss.backward()
            return loss
    elif name == "liger":
        cls, _ = peers["liger"]
        mod = cls(
            beta=LOSS_KW["beta"],
            compiled=False,
            use_ref_model=True,
            epsilon_low=LOSS_KW["epsilon_low"],
            epsilon_high=LOSS_KW["epsilon_high"],
            loss_type=LOSS_KW["loss_type"],
            temperature=1.0,
        )

        def run():
            out = mod(h, W, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            return loss
    elif name == "cce":
        lce, _ = peers["cce"]

        def run():
            nll = lce(h, W, ids, reduction="none")  # (B, T) = -logp
            loss = grpo_on_logps(-nll.float())
            loss.backward()
            return loss
    elif name == "trl":
        (fn, trl_chunk), _ = peers["trl"]
        H = h.shape[-1]

        def run():  # outputs=(): log-probs only (no entropy), as the peers above
            logp = fn.apply(h.reshape(-1, H), W, None, ids.reshape(-1), 1.0, trl_chunk, None, 1.0, ())[0]
            loss = grpo_on_logps(logp.view(ids.shape).float())
            loss.backward()
            return loss
    elif name == "unsloth":
        flp, _ = peers["unsloth"]

        def run():
            logp = flp(h, W, ids)
            loss = grpo_on_logps(logp.float())
            loss.backward()
            return loss
    else:
        raise ValueError(f"unknown implementation {name!r}")
    return run


# ------------------------------------------------------------------------------------------------
# measurement helpers
# ------------------------------------------------------------------------------------------------
def matmul_tflops(dev, dtype, m, k, n, reps=10):
    """Measured dense matmul rate for (m, k) @ (k, n) on random data, TFLOP/s (median)."""
    a = torch.randn(m, k, device=dev, dtype=dtype)
    b = torch.randn(k, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(dev)
    ts = [timed(lambda: a @ b, dev) for _ in range(reps)]
    del a, b
    return 2 * m * k * n / (statistics.median(ts) * 1e-3) / 1e12


def make_inputs(B, T, H, V, dev, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    W = (torch.randn(V, H, generator=g) * H**-0.5).to(dev, dtype)
    h = (torch.randn(B, T, H, generator=g) * 2.0).to(dev, dtype).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    mask = torch.ones(B, T, dtype=torch.int64, device=dev)
    adv = torch.randn(B, generator=g).to(dev)
    with torch.no_grad():
        lp = per_token_logps(h.detach(), W, ids)
    old = lp + 0.05 * torch.randn(B, T, generator=g).to(dev)  # a little off-policy: ratio != 1
    ref = lp + 0.05 * torch.randn(B, T, generator=g).to(dev)
    return dict(hidden=h, W=W, ids=ids, mask=mask, adv=adv, old=old, ref=ref)


def naive_fits(B, T, V, dev):
    """Full logits need ~12 bytes per (token, vocab) entry at peak (bf16 logits, fp32 copy, fp32
    log-softmax; measured 11.7 GiB at B*T*V = 1.05e9); skip when that exceeds free memory."""
    need = 12.5 * B * T * V
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return need < 0.9 * free, need
    return need < 8 * GiB, need


def bench_one(name, peers, inp, dev, warmup, reps, chunk_size=None):
    """Warm up, then time ``reps`` forward+backward passes; peak memory over the inputs."""
    run = make_runner(name, peers, inp, chunk_size)
    h = inp["hidden"]
    for _ in range(warmup):
        h.grad = None
        run()
    sync(dev)
    h.grad = None
    base = 0
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    last = [None]

    def step():
        last[0] = run()

    times = []
    for _ in range(reps):
        h.grad = None
        times.append(timed(step, dev))
    peak = (torch.cuda.max_memory_allocated(dev) - base) / GiB if dev.type == "cuda" else float("nan")
    grad = h.grad.detach().clone() if h.grad is not None else None
    h.grad = None
    return dict(
        ms=statistics.median(times),
        ms_all=[round(t, 3) for t in times],
        extra_gib=peak,
        loss=float(last[0].detach()),
        grad=grad,
    )


def gpu_tag(dev):
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev)
    return name.split()[-1].lower() if name else "gpu"


def fmt_cell(r):
    if r["status"] != "ok":
        return r["status"]
    return f"{r['ms']:.1f} ms ({r['x_floor']:.2f}x), {r['extra_gib']:.2f} GiB"


def write_report(out_dir, tag, meta, rows):
    lines = [
        f"# GRPO loss benchmark ({meta['device_name']})",
        "",
        f"- command: `{meta['command']}`",
        f"- date (UTC): {meta['date']}",
        f"- hardware: {meta['device_name']}; torch {meta['torch']}, triton {meta['triton']}, python {meta['python']}",
        f"- peers: {json.dumps(meta['peer_versions'])}",
        f"- bf16 matmul rate measured in this run: {meta['tflops_square']:.0f} TFLOP/s (8192^3); "
        f"head-shaped GEMMs: {json.dumps({k: round(v) for k, v in meta['tflops_head'].items()})} TFLOP/s",
        f"- workload: B={meta['batch']}, bf16 hidden and head weight, loss_type grpo, beta 0.04, eps 0.2, "
        "old/ref log-probs given, all tokens active; forward + backward w.r.t. hidden (head frozen)",
        f"- cell: median of {meta['reps']} after {meta['warmup']} warm-up (CUDA events), time over the matmul floor "
        "4*B*T*H*V / rate, extra peak memory over the inputs (hidden-state gradient included)",
        "",
    ]
    for head in meta["heads"]:
        hr = [r for r in rows if r["head"] == head]
        if not hr:
            continue
        H, V = hr[0]["H"], hr[0]["V"]
        Ts = sorted({r["T"] for r in hr})
        lines += [
            f"## {head} head (H={H}, V={V})",
            "",
            "| impl | " + " | ".join(f"T={t}" for t in Ts) + " |",
            "|---|" + "---|" * len(Ts),
        ]
        floor = {r["T"]: r["floor_ms"] for r in hr}
        gradsz = {r["T"]: r["grad_gib"] for r in hr}
        lines.append(
            "| matmul floor / hidden grad | "
            + " | ".join(f"{floor[t]:.1f} ms / {gradsz[t]:.2f} GiB" for t in Ts)
            + " |"
        )
        for impl in meta["impls"]:
            cells = []
            for t in Ts:
                rr = [r for r in hr if r["T"] == t and r["impl"] == impl]
                cells.append(fmt_cell(rr[0]) if rr else "")
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("Targets (ours): time <= unsloth's; extra peak <= hidden grad + 0.25 GiB:")
        for t in Ts:
            o = [r for r in hr if r["T"] == t and r["impl"] == "ours" and r["status"] == "ok"]
            u = [r for r in hr if r["T"] == t and r["impl"] == "unsloth" and r["status"] == "ok"]
            if o:
                o = o[0]
                tt = f"ours/unsloth time {o['ms'] / u[0]['ms']:.3f}" if u else "unsloth not measured"
                lines.append(
                    f"- T={t}: {tt}; extra peak {o['extra_gib']:.3f} GiB vs target {o['grad_gib'] + 0.25:.3f} GiB"
                )
        lines.append("")
        lines.append("Relative error vs ours (loss, hidden grad):")
        for r in hr:
            if r["status"] == "ok" and r["impl"] != "ours" and r.get("rel_loss") is not None:
                lines.append(f"- T={r['T']} {r['impl']}: loss {r['rel_loss']:.1e}, grad {r['rel_grad']:.1e}")
        lines.append("")
    notes = [r for r in rows if r["status"] != "ok"]
    if notes:
        lines += ["## Not measured, and why", ""]
        for r in notes:
            lines.append(f"- {r['head']} T={r['T']} {r['impl']}: {r['status']}: {r['reason']}")
        lines.append("")
    return record_report("loss", dict(meta=meta, rows=rows), lines, out_dir)


def gpu_check(dev):
    """Correctness of ours on the device: Triton vs torch epilogue vs an fp64 full-logits oracle."""
    out = {}
    g = torch.Generator(device="cpu").manual_seed(0)
    B, T, H, V = 3, 333, 256, 32003  # odd sizes: T*B not a multiple of the chunk, V not a power of 2
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        W = (torch.randn(V, H, generator=g) * H**-0.5).to(dev, dtype)
        h0 = (torch.randn(B, T, H, generator=g) * 2).to(dev, dtype)
        ids = torch.randint(0, V, (B, T), generator=g).to(dev)
        mask = (torch.rand(B, T, generator=g) > 0.2).to(dev)
        adv = torch.randn(B, generator=g).to(dev)
        h64 = h0.double().requires_grad_()
        lp64 = torch.log_softmax((h64 @ W.double().t()) / 0.8, -1).gather(-1, ids[..., None]).squeeze(-1)
        old = (lp64.detach() + 0.1 * torch.randn(B, T, generator=g).to(dev)).float()
        ref = (lp64.detach() + 0.1 * torch.randn(B, T, generator=g).to(dev)).float()
        kw = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="bnpo")
        l64, _ = grpo_loss_reference(lp64, old.double(), ref.double(), adv.double(), mask, **kw)
        l64.backward()
        for epi in ("triton", "torch") if dev.type == "cuda" else ("torch",):
            h = h0.clone().requires_grad_()
            loss, m = efficient_grpo_loss(
                h,
                W,
                ids,
                mask,
                adv,
                old_logps=old,
                ref_logps=ref,
                temperature=0.8,
                chunk_size=100,
                epilogue=epi,
                compute_entropy=True,
                **kw,
            )
            loss.backward()
            key = f"{str(dtype).split('.')[-1]}/{epi}"
            out[key] = dict(
                rel_loss=abs(loss.item() - l64.item()) / abs(l64.item()), rel_grad=rel_err(h.grad, h64.grad)
            )
            print("check", key, out[key], flush=True)
    return out


def micro(dev, heads, head_names, rows=1024):
    """Where one chunk's time goes: the two GEMMs, each epilogue pass, and a plain copy."""
    from grpo_kit.kernels import grpo_epilogue as E

    out = {}
    for hn in head_names:
        H, V = heads[hn]
        g = torch.Generator(device="cpu").manual_seed(1)
        h = torch.randn(rows, H, generator=g).to(dev, torch.bfloat16)
        W = (torch.randn(V, H, generator=g) * H**-0.5).to(dev, torch.bfloat16)
        ids = torch.randint(0, V, (rows,), generator=g).to(dev)
        z = h @ W.t()
        coef = torch.randn(rows, device=dev)
        lse = E.lse_logp_torch(z, ids, 1.0)[1]
        zc = z.clone()

        def med(fn, n=10):
            for _ in range(3):
                fn()
            sync(dev)
            return statistics.median(timed(fn, dev) for _ in range(n))

        r = {
            "gemm_fwd_ms": med(lambda: torch.mm(h, W.t(), out=zc)),
            "gemm_bwd_ms": med(lambda: torch.mm(z, W)),
            "copy_ms": med(lambda: zc.copy_(z)),
            "chunk_mib": z.numel() * 2 / 2**20,
        }
        for be in ["triton", "torch"] if dev.type == "cuda" else ["torch"]:
            r[f"lse_{be}_ms"] = med(lambda: E.lse_logp(z, ids, 1.0, False, be))
            r[f"grad_{be}_ms"] = med(lambda: E.softmax_grad_(zc, ids, lse, coef, 1.0, be))
        if dev.type == "cuda":
            lk, gk, tuned = E._kernels()
            if tuned:
                r["lse_best"] = str(getattr(lk, "best_config", None))
                r["grad_best"] = str(getattr(gk, "best_config", None))
        r["copy_GBps"] = 2 * z.numel() * 2 / (r["copy_ms"] * 1e-3) / 1e9
        out[hn] = r
        print("micro", hn, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        del h, W, z, zc
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="llama,qwen", help="comma list of: " + ",".join(HEADS))
    ap.add_argument("--lengths", default="1024,4096,8192,20480,32768,65536")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--impls", default="ours,ours_gspo,ours_cispo,ours_torch,trl,unsloth,cce,liger,naive")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--slow-max-len",
        type=int,
        default=8192,
        help="longest T for liger and ours_torch (3-12x the floor: they would eat the GPU budget)",
    )
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no new size after this many seconds")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny heads and lengths, for debugging on a CPU")
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--check", action="store_true", help="first check ours against an fp64 oracle on the device")
    ap.add_argument("--micro", action="store_true", help="time one chunk's GEMMs and epilogue passes")
    args = ap.parse_args(argv)

    t_start = time.time()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("CUDA not available: use --device cpu --tiny to debug")
        torch.zeros(1, device=dev)  # initialise CUDA (and its allocator) before any peer touches settings
    dtype = torch.bfloat16
    heads = TINY_HEADS if args.tiny else HEADS
    head_names = [x for x in args.heads.split(",") if x]
    for hn in head_names:
        if hn not in heads:
            raise SystemExit(f"--heads: unknown head {hn!r}; allowed: {sorted(heads)}")
    lengths = [16, 64, 100] if args.tiny else [int(x) for x in args.lengths.split(",")]
    impls = [x for x in args.impls.split(",") if x]
    allowed = ("ours", "ours_torch", *VARIANT_KW, "trl", "unsloth", "cce", "liger", "naive")
    for x in impls:
        if x not in allowed:
            raise SystemExit(f"--impls: unknown implementation {x!r}; allowed: {allowed}")
    if "ours" in impls:  # ours first: the others are checked against it
        impls = ["ours"] + [x for x in impls if x != "ours"]
    B = 2 if args.tiny else args.batch

    check = gpu_check(dev) if args.check else None
    micro_res = micro(dev, heads, head_names, rows=1024 if dev.type == "cuda" else 64) if args.micro else None
    peers, reasons = load_peers(impls)
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    tflops_sq = matmul_tflops(dev, dtype, *((8192,) * 3 if dev.type == "cuda" else (512,) * 3))
    tflops_head = {hn: matmul_tflops(dev, dtype, 4096 if dev.type == "cuda" else 256, *heads[hn]) for hn in head_names}
    meta = dict(
        command=" ".join(getattr(sys, "orig_argv", sys.argv)),
        argv=sys.argv,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        triton=triton_v,
        python=platform.python_version(),
        peer_versions={k: v[1] for k, v in peers.items()},
        peer_import_errors=reasons,
        tflops_square=tflops_sq,
        tflops_head=tflops_head,
        batch=B,
        reps=args.reps,
        warmup=args.warmup,
        heads=head_names,
        impls=impls,
        lengths=lengths,
        alloc_conf=os.environ.get("PYTORCH_ALLOC_CONF", ""),
        check=check,
        micro=micro_res,
    )
    print(
        f"matmul rate {tflops_sq:.0f} TFLOP/s; head GEMMs {tflops_head}; peers {meta['peer_versions']}; "
        f"import errors {reasons}",
        flush=True,
    )

    rows = []
    for T in lengths:  # length-major, so that every head gets the short lengths if the budget runs out
        for hn in head_names:
            H, V = heads[hn]
            floor_ms = 4 * B * T * H * V / (tflops_sq * 1e12) * 1e3
            base = dict(head=hn, H=H, V=V, B=B, T=T, floor_ms=floor_ms, grad_gib=B * T * H * 2 / GiB)
            if time.time() - t_start > args.budget_s:
                for impl in impls:
                    rows.append(
                        dict(base, impl=impl, status="not run", reason=f"time budget {args.budget_s:.0f} s spent")
                    )
                continue
            inp = make_inputs(B, T, H, V, dev, dtype, seed=T)
            ref_loss = ref_grad = None
            for impl in impls:
                row = dict(base, impl=impl, status="ok", reason="")
                if impl in ("liger", "cce", "unsloth", "trl") and impl not in peers:
                    row.update(status="not run", reason=reasons.get(impl, "not importable"))
                elif impl in ("liger", "ours_torch") and T > args.slow_max_len and not args.tiny:
                    row.update(status="not run", reason=f"T > --slow-max-len {args.slow_max_len} (time budget)")
                elif impl == "naive" and not naive_fits(B, T, V, dev)[0]:
                    row.update(
                        status="OOM",
                        reason=f"estimated {naive_fits(B, T, V, dev)[1] / GiB:.0f} GiB of logits "
                        "and copies exceeds free memory; not attempted",
                    )
                else:
                    try:
                        res = bench_one(impl, peers, inp, dev, args.warmup, args.reps)
                        row.update(
                            ms=res["ms"],
                            ms_all=res["ms_all"],
                            extra_gib=res["extra_gib"],
                            loss=res["loss"],
                            x_floor=res["ms"] / floor_ms,
                        )
                        if impl == "ours":
                            ref_loss, ref_grad = res["loss"], res["grad"]
                        elif ref_grad is not None and res["grad"] is not None and impl not in VARIANT_KW:
                            row.update(
                                rel_loss=abs(res["loss"] - ref_loss) / max(abs(ref_loss), 1e-30),
                                rel_grad=rel_err(res["grad"], ref_grad),
                            )
                        del res
                    except torch.OutOfMemoryError as e:
                        row.update(status="OOM", reason=str(e).splitlines()[0][:200])
                    except Exception as e:  # noqa: BLE001 - shown in the table, traceback in the log
                        traceback.print_exc()
                        row.update(
                            status="error",
                            reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                        )
                    inp["hidden"].grad = None
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                rel = f"  rel grad vs ours {row['rel_grad']:.1e}" if "rel_grad" in row else ""
                cell = fmt_cell(row) if row["status"] == "ok" else row["status"] + " " + row["reason"]
                print(f"{hn} T={T} {impl}: {cell}{rel}", flush=True)
            del inp, ref_grad
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    meta["wall_s"] = time.time() - t_start
    text = write_report(args.out_dir, gpu_tag(dev), meta, rows)
    print(text)


if __name__ == "__main__":
    main()
