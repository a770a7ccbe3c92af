"""The adapter merged into the shared weights and restored (``vllm_lora_sync: merge``) on real weights: how many
elements the restore has to keep, what they cost, how long a merge and a restore take, and that every bit comes
back.

    python -m grpo_kit bench reversible_merge [--adapter RUN_DIR/adapter] [--scales 1,4,16] [--device cpu]
                                              [--dtype bf16] [--tag cpu]

On the embedded SmolLM2-135M-Instruct (its real weights, in ``--dtype``) with a trained LoRA adapter (a run
folder's ``adapter/``, e.g. from ``python -m grpo_kit train``), its B factors multiplied by each of ``--scales``
(a longer or hotter run moves further from the base; 1 is the adapter as trained). Per scale: the delta's size
against the weights (median over the merged weights of mean|dW| / mean|W|), the share of elements the bf16 merge
changes, the share the restore keeps (``exceptions``) and their bytes in host RAM, merge and restore seconds, and
whether every base weight's bits came back. Results: ``bench/results/reversible_merge_<tag>.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from _common import command_line, hardware, hardware_line, sync, write_report

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _base_weights(pm) -> dict:
    return {n: p for n, p in pm.named_parameters() if ".base_layer.weight" in n}


def measure(pm, scale: float, dev) -> dict:
    from grpo_kit.generation.reversible_merge import ReversibleLoraMerge

    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(scale)
    merge = ReversibleLoraMerge(pm)
    weights = _base_weights(pm)
    before = {n: w.detach().clone() for n, w in weights.items()}
    ratios = []
    for name, layer in merge.targets:
        w = layer.get_base_layer().weight
        a = next(iter(layer.lora_A.values())).weight.float()
        b = next(iter(layer.lora_B.values())).weight.float()
        d = (b @ a) * float(next(iter(layer.scaling.values())))
        ratios.append(float(d.abs().mean() / w.float().abs().mean()))
    sync(dev)
    info = merge.merge()
    changed = sum(int((w.detach() != before[n]).sum()) for n, w in weights.items())
    back = merge.restore()
    exact = all(torch.equal(w.detach().view(torch.int16 if w.element_size() == 2 else torch.int32),
                            before[n].view(torch.int16 if w.element_size() == 2 else torch.int32))
                for n, w in weights.items())
    total = sum(w.numel() for w in weights.values())
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.div_(scale)
    return dict(scale=scale, delta_over_weight_median=statistics.median(ratios), weights=info["weights"],
                elements=total, changed_share=changed / total, exceptions=info["exceptions"],
                exception_share=info["exceptions"] / total, exception_mib=info["exception_bytes"] / 2**20,
                merge_s=info["seconds"], restore_s=back["seconds"], bits_restored=exact)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", required=True, help="a run folder's adapter/ (PEFT LoRA of the embedded model)")
    p.add_argument("--scales", default="1,4,16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    from peft import PeftModel

    from grpo_kit.models import load_model

    dev = torch.device(a.device)
    model, _ = load_model(dtype=DTYPES[a.dtype], device=a.device)
    pm = PeftModel.from_pretrained(model, a.adapter).eval()
    rows = [measure(pm, float(s), dev) for s in a.scales.split(",")]
    cmd = command_line("reversible_merge", argv)
    summary = Path(a.adapter).parent / "summary.json"  # the run that trained it, where the folder is a run folder
    run = None
    if summary.is_file():
        import json

        s = json.loads(summary.read_text())
        run = {k: s.get(k) for k in ("model", "task", "steps", "accuracy_before", "accuracy_after", "device")}
    hw = hardware(dev)
    lines = [f"# The adapter merged into the shared weights and restored ({a.tag})", "",
             f"Command: `{cmd}`", f"Hardware: {hardware_line(hw)}", "",
             f"Embedded SmolLM2-135M-Instruct, real weights in {a.dtype}, adapter `{a.adapter}` with its B factors "
             "scaled; every merged weight's elements counted." + (f" The adapter's run: {run}." if run else ""), "",
             "| B scale | mean abs(dW) / mean abs(W) (median) | elements changed by the merge | kept for the restore | "
             "kept MiB (host) | merge s | restore s | every bit back |", "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['scale']:g} | {r['delta_over_weight_median']:.2e} | {r['changed_share']:.2%} | "
                     f"{r['exception_share']:.3%} ({r['exceptions']:,}) | {r['exception_mib']:.2f} | "
                     f"{r['merge_s']:.3f} | {r['restore_s']:.3f} | {r['bits_restored']} |")
    print("\n".join(lines))
    write_report(Path(a.out_dir) / f"reversible_merge_{a.tag}", {"command": cmd, "hardware": hw, "adapter_run": run, "rows": rows}, lines)
    return 0 if all(r["bits_restored"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
