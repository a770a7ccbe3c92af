"""Where and in which dtype a run trains: a run's ``device`` and ``dtype`` (:class:`DeviceSpec`) resolved against
this machine (``auto``: CUDA when torch sees a GPU; bf16 where it supports it, fp16 with a GradScaler on
older GPUs such as the T4, fp32 on the CPU)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DeviceSpec:
    """Where and in which dtype a run asks to train (names and values as in the app's config, which builds it):
    ``device`` ``auto``, ``cpu`` or ``cuda``; ``dtype`` ``auto``, ``fp32``, ``bf16`` or ``fp16``."""

    device: str
    dtype: str

    @classmethod
    def of(cls, source) -> DeviceSpec:
        """``source`` itself, or the spec it makes: an object with ``spec(kind)``, such as the app's config
        (``GRPOKitConfig.spec``), so that a notebook may hand its config to :func:`resolve_device`."""
        return source if isinstance(source, cls) else source.spec(cls)


def resolve_device(run: DeviceSpec) -> str:
    """``run.device`` on this machine (``cpu`` or ``cuda``): ``auto`` is CUDA when torch sees a GPU, else the CPU,
    with a warning where a GPU is there that this torch cannot use. ``run``: a :class:`DeviceSpec`, or an object
    that makes one (:meth:`DeviceSpec.of`)."""
    device = DeviceSpec.of(run).device
    if device == "cuda" and not torch.cuda.is_available():
        why = unusable_gpu()
        raise ValueError(
            f"device='cuda' but torch sees no CUDA device{f': {why}' if why else ''}; use device=auto or cpu"
        )
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        why = unusable_gpu()
        if why:
            warnings.warn(f"training on the CPU: {why}", RuntimeWarning, stacklevel=2)
        return "cpu"
    return device


def resolve_dtype(run: DeviceSpec, device: str) -> torch.dtype:
    """``run.dtype`` on ``device``: as named, or for ``auto`` bf16 where the GPU supports it, fp16 on older GPUs
    (T4), fp32 on the CPU. ``run``: a :class:`DeviceSpec`, or an object that makes one."""
    dtype = DeviceSpec.of(run).dtype
    if dtype != "auto":
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def checkpointing_on(gradient_checkpointing: bool | str, device: str) -> bool:
    """Whether gradient checkpointing runs on ``device`` (``cpu`` / ``cuda``) for the config's
    ``gradient_checkpointing`` (true, false or ``auto``): ``auto`` means on a GPU, where it saves memory (on the CPU
    it would only recompute)."""
    return device == "cuda" if gradient_checkpointing == "auto" else bool(gradient_checkpointing)
