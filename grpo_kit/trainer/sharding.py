"""Sharded training (several processes): which accelerate configs the kit runs, and the output head gathered.

The kit's loss reads the output head's weight outside the model's forward (the efficient loss and the scoring
passes multiply the final hidden states by it chunk by chunk). Under FSDP2 (``fully_shard``) that weight is a
``DTensor`` holding one slice of the vocabulary rows per process; :func:`full_head` gathers it, and when the head
is trained its gradient goes back to the shards averaged over processes, as FSDP averages the others.

Proven on the CPU (gloo, ``tests/test_fsdp.py`` and ``tests/test_distributed.py``): one process, DDP, and FSDP2
(``fsdp_version: 2``). Anything else that accelerate can launch (FSDP1, DeepSpeed ZeRO of any stage) is refused
by :func:`check_sharding` with one message that names it, before the trainer prepares the model; the app can call
:func:`check_launch_env` before it loads one.
"""

from __future__ import annotations

import os

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin
from torch.distributed.tensor import DTensor, Partial

# What runs, for the refusal message.
PROVEN = "one process, DDP (configs/accelerate/ddp.yaml, cpu_2proc.yaml) and FSDP2 (fsdp.yaml, cpu_fsdp2.yaml)"


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def check_launch_env() -> None:
    """Refuse a sharding mode or stage without a passing test, from what ``accelerate launch`` put in the
    environment (so before any model loads). Raises ValueError naming it and what works."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "?")
        raise ValueError(f"DeepSpeed ZeRO stage {stage} is not supported by the kit yet: no test proves it (the "
                         f"output head is not gathered under ZeRO-3). What works: {PROVEN}.")
    if _flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ValueError(f"FSDP version {os.environ.get('FSDP_VERSION', '1')} (FSDP1) is not supported by the kit: "
                         f"no test proves it; set fsdp_version: 2 in the accelerate config. What works: {PROVEN}.")


def check_sharding(args, *, offload_checkpointing: bool | None = None) -> None:
    """Construction-time check of the trainer's launch: :func:`check_launch_env`, TrainingArguments' own
    ``fsdp`` / ``deepspeed`` options, and the kit's offloaded checkpointing under FSDP. On the CPU, FSDP2 is
    selected here (:func:`_select_fsdp_on_cpu`)."""
    check_launch_env()
    if getattr(args, "deepspeed", None):
        raise ValueError(f"TrainingArguments.deepspeed is not supported by the kit yet (no test proves it). "
                         f"What works: {PROVEN}.")
    if getattr(args, "fsdp", None) and str((getattr(args, "fsdp_config", None) or {}).get("version", 1)) != "2":
        raise ValueError(f"TrainingArguments.fsdp with FSDP1 is not supported by the kit (no test proves it); set "
                         f"fsdp_config={{'version': 2}}. What works: {PROVEN}.")
    fsdp = _flag("ACCELERATE_USE_FSDP") or bool(getattr(args, "fsdp", None))
    if offload_checkpointing is None:  # the trainer's default: on for gradient checkpointing on CUDA
        offload_checkpointing = (torch.cuda.is_available() and not getattr(args, "use_cpu", False)
                                 and bool(getattr(args, "gradient_checkpointing", False)))
    if fsdp and offload_checkpointing:
        # The kit's wrapper recomputes each decoder layer inside its own autograd function's backward, outside
        # the module call whose hooks make FSDP gather that layer's weights; FSDP's activation checkpointing
        # (fsdp_activation_checkpointing in the accelerate config) wraps the same layers the FSDP way.
        raise ValueError("offloaded checkpointing does not compose with FSDP's per-layer wrapping: its recompute "
                         "runs outside the layer call that gathers the layer's shards. Use "
                         "fsdp_activation_checkpointing: true in the accelerate config instead.")
    if fsdp and (_flag("ACCELERATE_USE_CPU") or getattr(args, "use_cpu", False)):
        _select_fsdp_on_cpu(args)


def _select_fsdp_on_cpu(args) -> None:
    """accelerate 1.16 selects FSDP only for accelerator devices: a CPU launch with an FSDP config silently runs
    DDP (its MULTI_CPU state never switches). Its shared state is set to FSDP here, with the plugin the launcher's
    environment describes, before the Trainer builds its Accelerator on that state; torch's ``fully_shard``
    runs on the CPU with gloo."""
    mixed = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    state = AcceleratorState(cpu=True, mixed_precision=mixed, dynamo_plugin=TorchDynamoPlugin(),
                             _from_accelerator=True)
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
