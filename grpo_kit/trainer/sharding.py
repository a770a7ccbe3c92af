"""Sharded training (several processes): which accelerate configs the kit runs, and the output head gathered.

The kit's loss reads the output head's weight outside the model's forward (the efficient loss and the scoring
passes multiply the final hidden states by it chunk by chunk). Under FSDP2 (``fully_shard``) that weight is a
``DTensor`` holding one slice of the vocabulary rows per process; :func:`full_head` gathers it, and when the head
is trained its gradient goes back to the shards averaged over processes, as FSDP averages the others.

Proven on the CPU (gloo, ``tests/test_fsdp.py`` and ``tests/test_distributed.py``): one process, DDP, and FSDP2
(``fsdp_version: 2``). Anything else that accelerate can launch (FSDP1, DeepSpeed ZeRO of any stage) is refused
by :func:`check_sharding` with one message that names it, before the trainer prepares the model; the app calls
:func:`check_launch_env` before it loads one.

Checkpoints of a sharded model (:mod:`grpo_kit.trainer.checkpoints`) keep the one-process format: every process
takes part in gathering the saved tensors whole (:func:`whole_state`, :func:`whole_adapter`, :func:`save_whole`), the
main one writes them, and on resume every process cuts the whole tensors it reads to its own shards (:func:`loading_whole_tensors`,
:func:`shard_optimizer_state`).
"""

from __future__ import annotations

import contextlib
import os

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Partial, distribute_tensor

# torch's activation-checkpointing wrapper in module names (FSDP's activation checkpointing); state_dict() keys
# leave it out.
CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."

# What runs, for the refusal message.
PROVEN = "one process, DDP (configs/accelerate/ddp.yaml, cpu_2proc.yaml) and FSDP2 (fsdp.yaml, cpu_fsdp2.yaml)"


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def check_launch_env() -> None:
    """Refuse a sharding mode or stage without a passing test, from what ``accelerate launch`` put in the
    environment (so before any model loads). Raises ValueError naming it and what works."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "?")
        raise ValueError(
            f"DeepSpeed ZeRO stage {stage} is not supported by the kit yet: no test proves it (the "
            f"output head is not gathered under ZeRO-3). What works: {PROVEN}."
        )
    if _flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ValueError(
            f"FSDP version {os.environ.get('FSDP_VERSION', '1')} (FSDP1) is not supported by the kit: "
            f"no test proves it; set fsdp_version: 2 in the accelerate config. What works: {PROVEN}."
        )


def check_sharding(args, *, offload_checkpointing: bool | None = None) -> None:
    """Construction-time check of the trainer's launch: :func:`check_launch_env`, TrainingArguments' own
    ``fsdp`` / ``deepspeed`` options, and the kit's offloaded checkpointing under FSDP. On the CPU, FSDP2 is
    selected here (:func:`_select_fsdp_on_cpu`)."""
    check_launch_env()
    if getattr(args, "deepspeed", None):
        raise ValueError(
            f"TrainingArguments.deepspeed is not supported by the kit yet (no test proves it). What works: {PROVEN}."
        )
    if getattr(args, "fsdp", None) and str((getattr(args, "fsdp_config", None) or {}).get("version", 1)) != "2":
        raise ValueError(
            f"TrainingArguments.fsdp with FSDP1 is not supported by the kit (no test proves it); set "
            f"fsdp_config={{'version': 2}}. What works: {PROVEN}."
        )
    fsdp = _flag("ACCELERATE_USE_FSDP") or bool(getattr(args, "fsdp", None))
    if offload_checkpointing is None:  # the trainer's default: on for gradient checkpointing on CUDA
        offload_checkpointing = (
            torch.cuda.is_available()
            and not getattr(args, "use_cpu", False)
            and bool(getattr(args, "gradient_checkpointing", False))
        )
    if fsdp and offload_checkpointing:
        # The kit's wrapper recomputes each decoder layer inside its own autograd function's backward, outside
        # the module call whose hooks make FSDP gather that layer's weights; FSDP's activation checkpointing
        # (fsdp_activation_checkpointing in the accelerate config) wraps the same layers the FSDP way.
        raise ValueError(
            "offloaded checkpointing does not compose with FSDP's per-layer wrapping: its recompute "
            "runs outside the layer call that gathers the layer's shards. Use "
            "fsdp_activation_checkpointing: true in the accelerate config instead."
        )
    if fsdp and (_flag("ACCELERATE_USE_CPU") or getattr(args, "use_cpu", False)):
        _select_fsdp_on_cpu(args)


def _select_fsdp_on_cpu(args) -> None:
    """accelerate 1.16 selects FSDP only for accelerator devices: a CPU launch with an FSDP config silently runs
    DDP (its MULTI_CPU state never switches). Its shared state is set to FSDP here, with the plugin the launcher's
    environment describes, before the Trainer builds its Accelerator on that state; torch's ``fully_shard``
    runs on the CPU with gloo."""
    mixed = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    state = AcceleratorState(cpu=True, mixed_precision=mixed, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.fsdp_plugin = FullyShardedDataParallelPlugin()
        if mixed != "no":
            state.fsdp_plugin.set_mixed_precision(mixed)
        # both shared states: AcceleratorState copies PartialState's each time it is built
        state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


def _full(param):
    """The whole tensor of ``param``: itself, or its FSDP2 shards gathered (differentiably when trained: the
    gradient of the full tensor is reduce-scattered to the shards, averaged over processes as FSDP does)."""
    if not isinstance(param, DTensor):
        return param
    if not param.requires_grad:
        return param.detach().full_tensor()
    return param.full_tensor(grad_placements=[Partial("avg")] * len(param.placements))


def full_head(causal_lm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (V, H), bias (V,) or None) of ``causal_lm``'s output head, whole on every process.

    Under FSDP2 the head's parameters are DTensors sharded over the vocabulary rows, or, just after a forward
    whose group keeps them gathered (accelerate's ``reshard_after_forward=False`` tail), full tensors that FSDP
    reduces only through its own hooks; a trained head is resharded first, so its gradient always takes the
    one path of :func:`_full`. Without sharding: the parameters themselves.
    """
    head = causal_lm.get_output_embeddings()
    bias = getattr(head, "bias", None)
    if head.weight.requires_grad and not isinstance(head.weight, DTensor) and hasattr(head, "reshard"):
        head.reshard()  # an FSDPModule left unsharded after the forward
    return _full(head.weight), None if bias is None else _full(bias)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 shards any of ``module``'s parameters (DTensors)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def map_tensors(obj, fn):
    """``obj`` (nested dicts, lists and tuples) with ``fn`` applied to each tensor in it."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def whole_state(obj, *, keep: bool):
    """``obj`` (nested dicts, lists and tuples of tensors and scalars, e.g. a state dict) with every DTensor gathered
    whole onto the CPU, one at a time. Collective: every process calls it on the same structure (same order).
    ``keep``: this process writes the result; the others gather, drop each tensor at once and get None."""

    def whole(t):
        if not isinstance(t, DTensor):
            return t
        full = t.detach().full_tensor()
        return full.cpu() if keep else None

    out = map_tensors(obj, whole)
    return out if keep else None


def _adapter_tensors(peft_model: torch.nn.Module) -> dict:
    """The adapter's parameters (and buffers) themselves, by the keys PEFT's ``save_pretrained`` writes (without the
    adapter name). PEFT picks them by the modules' names, which under FSDP's activation checkpointing carry torch's
    wrapper (its own state-dict functions then pick none), so the pick runs on those names and the wrapper's part
    is taken out of the keys after."""
    from peft import get_peft_model_state_dict  # lazy: peft imports transformers; LoRA checkpoints only

    named = {**dict(peft_model.named_parameters()), **dict(peft_model.named_buffers())}
    picked = get_peft_model_state_dict(peft_model, state_dict=named)
    return {k.replace(CHECKPOINT_WRAPPER, ""): v for k, v in picked.items()}


def whole_adapter(peft_model: torch.nn.Module, *, keep: bool) -> dict | None:
    """The adapter's tensors as ``save_pretrained`` writes them, gathered whole (:func:`whole_state`); the frozen
    base weights are not gathered."""
    return whole_state(_adapter_tensors(peft_model), keep=keep)


@torch.no_grad()
def load_whole_adapter(peft_model: torch.nn.Module, tensors: dict) -> None:
    """Copy ``tensors`` (an adapter file's, whole, on every process) into ``peft_model``'s adapter, each process
    keeping its shards. Raises ValueError naming the keys that do not fit."""
    own = _adapter_tensors(peft_model)
    if tensors.keys() != own.keys():
        raise ValueError(f"adapter tensors that do not fit the model: {sorted(tensors.keys() ^ own.keys())[:5]}")
    for key, value in tensors.items():
        target = own[key]
        target.copy_(_shard_like(value, target) if isinstance(target, DTensor) else value)


def write_adapter(peft_model: torch.nn.Module, folder: str | os.PathLike, tensors: dict) -> None:
    """``peft_model.save_pretrained(folder)`` (safetensors) with ``tensors`` (:func:`whole_adapter`) as its weights:
    PEFT writes its config and card, the weights file is written here."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME  # lazy: peft imports transformers; LoRA checkpoints only

    peft_model.save_pretrained(folder, safe_serialization=True, state_dict={})
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(folder, SAFETENSORS_WEIGHTS_NAME),
        metadata={"format": "pt"},
    )


def save_whole(model: torch.nn.Module, folder: str | os.PathLike, *, writes: bool) -> None:
    """``model.save_pretrained(folder)`` (safetensors; a PEFT model: its adapter) by the process that ``writes``. Where
    FSDP2 shards the model, every process must call it: they gather the tensors whole, the writing one writes."""
    if not is_sharded(model):
        if writes:
            model.save_pretrained(folder, safe_serialization=True)
        return
    if hasattr(model, "peft_config"):
        tensors = whole_adapter(model, keep=writes)
        if writes:
            write_adapter(model, folder, tensors)
        return
    tensors = whole_state(model.state_dict(), keep=writes)
    if writes:
        model.save_pretrained(folder, safe_serialization=True, state_dict=tensors)


def _shard_like(value: torch.Tensor, target: DTensor) -> DTensor:
    """``value`` (whole, on every process) cut to this process's part of ``target``'s layout, without
    communication."""
    return distribute_tensor(value.to(target.device), target.device_mesh, target.placements, src_data_rank=None)


@contextlib.contextmanager
def loading_whole_tensors(model: torch.nn.Module):
    """While open, ``model.load_state_dict`` (and PEFT's ``set_peft_model_state_dict``, which calls it) takes whole
    tensors for the FSDP2-sharded entries: each is cut to this process's shard first (a DTensor parameter copies
    only from a DTensor). Every process must hold the whole tensors."""
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, DTensor)}

    def cut(module, state_dict, prefix, *args):
        for key, value in state_dict.items():
            target = targets.get(key[len(prefix) :])
            if target is not None and not isinstance(value, DTensor) and value.shape == target.shape:
                state_dict[key] = _shard_like(value, target)

    handle = model.register_load_state_dict_pre_hook(cut)
    try:
        yield
    finally:
        handle.remove()


def shard_optimizer_state(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A whole optimizer state dict (torch's format, as one process saves it: per-parameter state keyed by the
    parameter's position in ``optimizer.param_groups``) with each tensor of a sharded parameter's shape (moments)
    cut to this process's shard, ready for ``optimizer.load_state_dict``; scalars (``step``) stay whole."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per_param in state["state"].items():
        param = params[int(index)]
        if isinstance(param, DTensor):
            for name, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    per_param[name] = _shard_like(value, param)
    return state
