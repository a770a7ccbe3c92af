"""Where and in which dtype a run trains: ``device`` and ``dtype`` of a ``GRPOKitConfig`` resolved against
this machine (``auto``: CUDA when torch sees a GPU; bf16 where it supports it, fp16 with a GradScaler on
older GPUs such as the T4, fp32 on the CPU)."""

from __future__ import annotations

import warnings

import torch

from grpo_kit.model import cuda_driver


def unusable_gpu() -> str | None:
    """Why torch sees no CUDA device while the NVIDIA driver shows one (a CPU build of torch, or one built for a
    newer CUDA than the driver runs), or None: torch sees one, there is none, or the reason is neither."""
    if torch.cuda.is_available():
        return None
    gpu = cuda_driver.gpu_name()
    if gpu is None:
        return None
    if torch.version.cuda is None:
        return f"the GPU {gpu} is present but this torch ({torch.__version__}) is a CPU build: install a CUDA build"
    why = cuda_driver.torch_blocked(torch.version.cuda, cuda_driver.driver_version())
    return f"the GPU {gpu} is present but {why}" if why else None


def resolve_device(cfg) -> str:
    """``cfg.device`` on this machine: ``auto`` is CUDA when torch sees a GPU, else the CPU, with a warning
    where a GPU is there that this torch cannot use."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        why = unusable_gpu()
        raise ValueError(f"device='cuda' but torch sees no CUDA device{f': {why}' if why else ''}; use device=auto "
                         "or cpu")
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        why = unusable_gpu()
        if why:
            warnings.warn(f"training on the CPU: {why}", RuntimeWarning, stacklevel=2)
        return "cpu"
    return cfg.device


def resolve_dtype(cfg, device: str) -> torch.dtype:
    """bf16 where the GPU supports it, fp16 on older GPUs (T4), fp32 on the CPU."""
    if cfg.dtype != "auto":
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
