"""Where and in which dtype a run trains: ``device`` and ``dtype`` of a ``GRPOKitConfig`` resolved against
this machine (``auto``: CUDA when torch sees a GPU; bf16 where it supports it, fp16 with a GradScaler on
older GPUs such as the T4, fp32 on the CPU)."""

from __future__ import annotations

import torch


def resolve_device(cfg) -> str:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device=auto or cpu")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def resolve_dtype(cfg, device: str) -> torch.dtype:
    """bf16 where the GPU supports it, fp16 on older GPUs (T4), fp32 on the CPU."""
    if cfg.dtype != "auto":
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
