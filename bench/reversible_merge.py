"""The adapter merged into the shared weights and restored (``vllm_lora_sync: merge``) on real weights: how many
elements the restore has to keep, what they cost, how long a merge and a restore take, and that every bit comes
back.

    python -m grpo_kit bench reversible_merge [--adapter RUN_DIR/adapter] [--scales 1,4,16] [--device cpu]
                                              [--dtype bf16] [--tag cpu]
    python -m grpo_kit bench reversible_merge --model llama-3.1-8b --device cuda --repeat 4 --profile --tag h200

On the embedded SmolLM2-135M-Instruct (its real weights, in ``--dtype``) with a trained LoRA adapter (a run
folder's ``adapter/``, e.g. from ``python -m grpo_kit train``), its B factors multiplied by each of ``--scales``
(a longer or hotter run moves further from the base; 1 is the adapter as trained). Or, with ``--model``, a
built-in architecture with random weights and a random LoRA adapter (r=16 on every linear layer) whose B factors
are sized so that each weight's mean|dW| / mean|W| is ``--delta`` (default 1.4e-3: the trained embedded
adapter's median), for where the time of a merge goes at full size (the 8B's 224 weights). Per scale: the
delta's size against the weights (median over the merged weights of mean|dW| / mean|W|), the share of elements
the merge changes, the share the restore keeps (``exceptions``) and their bytes in host RAM, merge and restore
seconds (with ``--repeat N``: the first round and the median of the others, the steady state of a training
run), and whether every base weight's bits came back. ``--profile``: one more merge and restore under
torch.profiler, the top ops by host and by GPU time. Results: ``bench/results/reversible_merge_<tag>.md`` /
``.json``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from _common import LORA_TARGETS, command_line, hardware, hardware_line, kernel_profile, record_report, sync

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _base_weights(pm) -> dict:
    return {n: p for n, p in pm.named_parameters() if ".base_layer.weight" in n}


def measure(pm, scale: float, dev, repeat: int = 1, profile: bool = False) -> dict:
    from grpo_kit.generation.reversible_merge import ReversibleLoraMerge

    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(scale)
    merge = ReversibleLoraMerge(pm)
    weights = _base_weights(pm)
    before = {n: w.detach().clone() for n, w in weights.items()}
    ratios = [_delta_ratio(layer) for _, layer in merge.targets]
    sync(dev)
    info = merge.merge()
    changed = sum(int((w.detach() != before[n]).sum()) for n, w in weights.items())
    back = merge.restore()
    rounds = [(info["seconds"], back["seconds"])]
    for _ in range(repeat - 1):  # the steady state: the kernel probed, page-locked host buffers cached
        rounds.append((merge.merge()["seconds"], merge.restore()["seconds"]))
    prof = None
    if profile:
        prof = kernel_profile(lambda: (merge.merge(), merge.restore()), dev)
    exact = all(
        torch.equal(
            w.detach().view(torch.int16 if w.element_size() == 2 else torch.int32),
            before[n].view(torch.int16 if w.element_size() == 2 else torch.int32),
        )
        for n, w in weights.items()
    )
    total = sum(w.numel() for w in weights.values())
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.div_(scale)
    steady = rounds[1:] or rounds
    row = dict(
        scale=scale,
        delta_over_weight_median=statistics.median(ratios),
        weights=info["weights"],
        elements=total,
        changed_share=changed / total,
        exceptions=info["exceptions"],
        exception_share=info["exceptions"] / total,
        exception_mib=info["exception_bytes"] / 2**20,
        merge_s=info["seconds"],
        restore_s=back["seconds"],
        rounds=len(rounds),
        merge_s_steady=statistics.median(m for m, _ in steady),
        restore_s_steady=statistics.median(r for _, r in steady),
        bits_restored=exact,
    )
    if prof is not None:
        row["profile"] = prof
    return row


@torch.no_grad()
def _delta_ratio(layer) -> float:
    """mean|dW| / mean|W| of one PEFT LoRA layer's active adapter."""
    w = layer.get_base_layer().weight
    a = next(iter(layer.lora_A.values())).weight.float()
    b = next(iter(layer.lora_B.values())).weight.float()
    d = (b @ a) * float(next(iter(layer.scaling.values())))
    return float(d.abs().mean() / w.float().abs().mean())


def random_adapter_model(name: str, dtype, dev, delta: float):
    """A built-in architecture with random weights on ``dev`` and a random LoRA adapter (r=16, every linear
    layer) whose B factors give each weight mean|dW| / mean|W| = ``delta``."""
    import peft

    from grpo_kit.model.loading import build_random_model

    model = build_random_model(name, dtype=dtype, device=dev)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for module in pm.modules():
            if hasattr(module, "lora_B") and module.lora_B:
                b = next(iter(module.lora_B.values())).weight
                b.copy_(torch.randn(b.shape, generator=g).to(b.device, b.dtype))
                b.mul_(delta / _delta_ratio(module))
    return pm.eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", help="a run folder's adapter/ (PEFT LoRA of the embedded model)")
    p.add_argument("--model", help="instead of --adapter: a built-in architecture, random weights and adapter")
    p.add_argument("--delta", type=float, default=1.4e-3, help="with --model: each weight's mean|dW| / mean|W|")
    p.add_argument("--repeat", type=int, default=1, help="merge and restore rounds per scale")
    p.add_argument("--profile", action="store_true", help="one more round under torch.profiler")
    p.add_argument("--scales", default="1,4,16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    if (a.adapter is None) == (a.model is None):
        p.error("give one of --adapter (the embedded model's trained adapter) or --model (random weights)")
    if a.repeat < 1:
        p.error(f"--repeat {a.repeat} is not allowed: 1 or more")
    dev = torch.device(a.device)
    if a.model:
        pm = random_adapter_model(a.model, DTYPES[a.dtype], dev, a.delta)
    else:
        from peft import PeftModel

        from grpo_kit.model.loading import load_model

        model, _ = load_model(dtype=DTYPES[a.dtype], device=a.device)
        pm = PeftModel.from_pretrained(model, a.adapter).eval()
    rows = [measure(pm, float(s), dev, a.repeat, a.profile) for s in a.scales.split(",")]
    cmd = command_line("reversible_merge", argv)
    summary = Path(a.adapter).parent / "summary.json" if a.adapter else None  # the run that trained it
    run = None
    if summary is not None and summary.is_file():
        import json

        s = json.loads(summary.read_text())
        run = {k: s.get(k) for k in ("model", "task", "steps", "accuracy_before", "accuracy_after", "device")}
    hw = hardware(dev)
    lines = [
        f"# The adapter merged into the shared weights and restored ({a.tag})",
        "",
        f"Command: `{cmd}`",
        f"Hardware: {hardware_line(hw)}",
        "",
        (
            f"{a.model} with random weights in {a.dtype} and a random LoRA adapter (r=16, every linear layer, "
            f"mean|dW| / mean|W| = {a.delta:g} per weight)"
            if a.model
            else f"Embedded SmolLM2-135M-Instruct, real weights in {a.dtype}, adapter `{a.adapter}`"
        )
        + " with its B factors scaled; every merged weight's elements counted."
        + (f" The adapter's run: {run}." if run else "")
        + f" {a.repeat} merge and restore round(s) per scale; steady = the median of the rounds after the first.",
        "",
        "| B scale | mean abs(dW) / mean abs(W) (median) | elements changed by the merge | kept for the restore | "
        "kept MiB (host) | merge s (first / steady) | restore s (first / steady) | every bit back |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        lines.append(
            f"| {r['scale']:g} | {r['delta_over_weight_median']:.2e} | {r['changed_share']:.2%} | "
            f"{r['exception_share']:.3%} ({r['exceptions']:,}) | {r['exception_mib']:.2f} | "
            f"{r['merge_s']:.3f} / {r['merge_s_steady']:.3f} | {r['restore_s']:.3f} / "
            f"{r['restore_s_steady']:.3f} | {r['bits_restored']} |"
        )
    for r in rows:
        if "profile" in r:
            pr = r["profile"]
            lines += [
                "",
                f"Profile of one more merge + restore at scale {r['scale']:g}: wall {pr['wall_s_profiled']:.3f} s, "
                f"host (self CPU) {pr['cpu_total_ms']:.1f} ms, GPU (self CUDA) {pr['cuda_total_ms']:.1f} ms.",
                "",
                "| op (by host time) | calls | self CPU ms | self CUDA ms |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| `{e['name']}` | {e['calls']} | {e['self_cpu_ms']:.2f} | {e['self_cuda_ms']:.2f} |"
                for e in pr["top_cpu"][:15]
            ]
    print("\n".join(lines))
    record_report(
        "reversible_merge", {"command": cmd, "hardware": hw, "adapter_run": run, "rows": rows}, lines, a.out_dir
    )
    return 0 if all(r["bits_restored"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
