"""After a run: the trained model from its run folder, a question answered before and after, merged 16-bit
weights, and an optional push to the Hugging Face Hub.

A run folder holds ``config.yaml`` and ``adapter/`` (LoRA) or ``model/`` (full fine-tuning); see
:func:`grpo_kit.app.run.train`. Nothing here writes into the run folder unless asked (``save_merged`` refuses an
existing, non-empty target folder unless ``overwrite=True``, which moves the old one aside).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.model.loading import load_model, load_tokenizer
from grpo_kit.tasks.data import default_system_prompt, make_prompt

__all__ = ["run_config", "load_base", "load_trained", "answer", "before_after", "save_merged", "push_to_hub"]


def run_config(run_dir: str | os.PathLike) -> GRPOKitConfig:
    """The config a run folder was trained with; ValueError naming the folder when it is not one."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not a grpo_kit run folder: it has no config.yaml")
    return GRPOKitConfig.from_yaml(path)


def load_base(run_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str = "cpu"):
    """``(model, tokenizer)``: the run's base model as it was before training (16-bit, no adapter)."""
    return load_model(run_config(run_dir).model, dtype=dtype, device=device)


def load_trained(run_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str = "cpu"):
    """``(model, tokenizer)``: the base model with the run's trained adapter (``adapter/``), or the fully
    fine-tuned weights (``model/``), from the run folder. Runs trained in 4 bit load on 16-bit base
    weights here (the adapter was trained against their NF4 rounding; merging targets 16 bit)."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    if (run_dir / "adapter").is_dir():
        from peft import PeftModel  # lazy: peft is slow to import and full fine-tuning does not need it

        base, tok = load_base(run_dir, dtype=dtype, device=device)
        return PeftModel.from_pretrained(base, str(run_dir / "adapter")).to(device).eval(), tok
    if (run_dir / "model").is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype=dtype or torch.float32)
        return model.to(device).eval(), load_tokenizer(cfg.model)
    raise ValueError(
        f"{str(run_dir)!r} holds no trained weights (no adapter/ or model/ folder): did the run reach its first save?"
    )


@torch.no_grad()
def answer(
    model,
    tokenizer,
    question: str,
    *,
    system_prompt: str | None = None,
    task: str = "arithmetic",
    max_new_tokens: int = 64,
) -> str:
    """The model's greedy answer to ``question``, in the chat format training used."""
    text = tokenizer.apply_chat_template(
        make_prompt(question, system_prompt or default_system_prompt(task)), tokenize=False, add_generation_prompt=True
    )
    device = next(model.parameters()).device
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def before_after(
    run_dir: str | os.PathLike,
    questions: list[str],
    *,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    max_new_tokens: int = 64,
) -> list[dict]:
    """Each question answered by the base model and by the trained one (greedy, the run's system prompt and
    task). A LoRA run loads once: "before" is the same model with its adapter disabled. Returns
    ``[{"question", "before", "after"}]``."""
    cfg = run_config(run_dir)
    model, tok = load_trained(run_dir, dtype=dtype, device=device)
    kw = dict(system_prompt=cfg.system_prompt or None, task=cfg.task, max_new_tokens=max_new_tokens)
    after = [answer(model, tok, q, **kw) for q in questions]
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            before = [answer(model, tok, q, **kw) for q in questions]
    else:  # full fine-tuning: the base is another model
        del model
        base, _ = load_base(run_dir, dtype=dtype, device=device)
        before = [answer(base, tok, q, **kw) for q in questions]
    return [{"question": q, "before": b, "after": a} for q, b, a in zip(questions, before, after)]


def save_merged(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Merge the run's adapter into its base weights and save a plain 16-bit ``transformers`` checkpoint
    (safetensors + tokenizer) to ``out_dir``; returns it. ``dtype``: bf16, or fp16 for GPUs without bf16;
    the merge runs in that dtype on ``device`` (an 8B in bf16 needs 16 GB there: use ``device="cuda"``
    where host RAM is short).

    A non-empty ``out_dir`` is refused unless ``overwrite=True``, which renames it to
    ``OUT.replaced-<UTC time>`` first (never deletes it)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype={dtype!r} is not allowed: torch.bfloat16, torch.float16 or torch.float32")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(
                f"{str(out)!r} already exists and is not empty; pass overwrite=True to move it "
                "aside, or choose another folder"
            )
        out.rename(out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"))
    bar = tqdm(total=3, desc="export", unit="stage", disable=not progress, leave=False)
    model, tok = load_trained(run_dir, dtype=dtype, device=device)
    bar.update()
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model = model.to(dtype).to("cpu")
    bar.update()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    bar.update()
    bar.close()
    return out


def push_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool = True, token: str | None = None) -> str:
    """Upload a saved folder (e.g. :func:`save_merged`'s) to the Hub as ``repo_id``; needs network and a token
    (``HF_TOKEN`` or ``huggingface-cli login``). Returns the repo URL."""
    from huggingface_hub import HfApi  # lazy: only for an upload, which few runs make

    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"repo_id={repo_id!r} is not allowed: 'user/name' or 'org/name'")
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id)
    return str(url)
