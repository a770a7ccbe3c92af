"""Standby: a CUDA vLLM engine gives its KV cache back while training runs; its weights stay put.

vLLM's own ``sleep(level=1)`` copies the weights to host RAM and unmaps them, which would pull the
memory out from under a training model whose weights are views of them
(:mod:`grpo_kit.generation.shared_weights`). With sleep mode on, vLLM allocates the weights and the
KV cache from its CuMem pool under the tags ``weights`` and ``kv_cache``. :func:`standby_in_worker`
unmaps only the ``kv_cache`` allocations: their physical memory goes back to the driver, so the
training step can use it, while the virtual addresses stay reserved, so the engine's tensors and
captured CUDA graphs stay valid. :func:`resume_in_worker` maps fresh memory at the same addresses
and runs the model runner's post-wake hook, as vLLM's ``wake_up`` does. KV contents are discarded:
the caller resets the prefix cache before standby. Both run inside the in-process worker
(``LLM.collective_rpc``) and return the bytes they released or mapped.
"""

from __future__ import annotations

import torch

KV_TAG = "kv_cache"


def _kv_allocations(asleep: bool):
    from vllm.device_allocator.cumem import CuMemAllocator  # lazy: vLLM is optional and slow to import

    return [
        d
        for d in CuMemAllocator.get_instance().pointer_to_data.values()
        if d.tag == KV_TAG and bool(d.is_asleep) == asleep
    ]


def standby_in_worker(worker) -> int:
    from vllm.device_allocator.cumem import unmap_and_release  # lazy: vLLM is optional and slow to import

    torch.cuda.synchronize()  # no kernel may still read the cache
    released = 0
    for data in _kv_allocations(asleep=False):
        unmap_and_release(data.handle)
        data.is_asleep = True
        released += data.handle[1]
    return released


def resume_in_worker(worker) -> int:
    from vllm.device_allocator.cumem import create_and_map  # lazy: vLLM is optional and slow to import

    pending = _kv_allocations(asleep=True)
    need = sum(d.handle[1] for d in pending)
    free, _ = torch.cuda.mem_get_info()
    if need > free:
        raise MemoryError(
            f"the KV cache needs {need / 2**30:.2f} GiB to come back but only {free / 2**30:.2f} GiB "
            "of the GPU is free (the training step holds the rest)"
        )
    for data in pending:
        create_and_map(data.handle)
        data.is_asleep = False
    worker.model_runner.post_kv_cache_wake_up()
    return need


def kv_bytes_in_worker(worker) -> int:
    """Bytes of the engine's KV cache allocations (mapped or not) in vLLM's CuMem pool."""
    from vllm.device_allocator.cumem import CuMemAllocator  # lazy: vLLM is optional and slow to import

    return sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.tag == KV_TAG)
