"""bench/rl_step.py's pieces that need no GPU: the generation rows' engine options pass the generator's checks, bad
arguments stop it before any row, and its memory phases label their calls."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from rl_step import GEN_ROWS, decode_kind, gen_engine_options, main  # noqa: E402

from grpo_kit.generation.vllm_backend import _check_fp8_options  # noqa: E402


@pytest.mark.parametrize("name", [n for n in GEN_ROWS if n.startswith("gen_vllm")])
@pytest.mark.parametrize("dual_stream", [True, False])
def test_generation_rows_start_engines_the_generator_accepts(name, dual_stream):
    opts, adapter = gen_engine_options(name, dual_stream)
    # the check VLLMGenerator runs before it starts an engine (CUDA: the rows run there)
    _check_fp8_options(
        "cuda",
        base_weights=opts["base_weights"],
        fp8_block=None,
        share_weights=opts["share_weights"],
        lora_sync=opts["lora_sync"],
    )
    assert adapter == (name == "gen_vllm_fp8w")  # only the FP8 step's engine runs an adapter
    assert opts["lora_dual_stream"] == (adapter and dual_stream)  # a second stream only where LoRA kernels run
    assert (opts["base_weights"] == "fp8") == opts["share_weights"]  # FP8 engines serve the training model's codes


@pytest.mark.parametrize(
    "kernel, kind",
    [
        ("_lora_shrink_kernel", "lora"),
        ("_lora_expand_kernel", "lora"),
        ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::Float8_e4m3fn, c10::BFloat16>", "quantise"),
        (
            "void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t, cutlass::bfloat16_t>>",
            "fp8_gemm",
        ),
        ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention"),
        (
            "triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_fused_add_rms_norm_max_mul_reciprocal_unsqueeze_3",
            "quantise",
        ),
        (
            "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>",
            "kv_write",
        ),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
        ("triton_red_fused__to_copy_add_mean_mul_rsqrt_0", "other"),
        ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>", "norm_act"),
    ],
)
def test_decode_kernels_are_sorted_by_what_they_do(kernel, kind):
    # the decode profile's sums: a LoRA launch must never be counted as a GEMM, nor the FP8 quantiser as one
    assert decode_kind(kernel) == kind


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--scoring-batch", "0"], "--scoring-batch '0'"),
        (["--scoring-batch", "two"], "a whole number >= 1, or auto"),
        (["--memory-history", "-1"], "or 0 (off)"),
        (["--sample-ms", "0"], "--sample-ms 0.0: a number of milliseconds > 0"),
        (["--profile-decode", "many"], "invalid int value: 'many'"),
        (["--memory-history-at", "loss"], "invalid choice: 'loss'"),
        (["--completion", "64", "--gen-tokens", "128"], "at most --completion 64"),
        (["--prompt", "0"], "--prompt 0: a number of tokens >= 1"),
        (["--micro-batch", "3"], "invalid choice: 3"),
        (["--prefix-sharing", "yes"], "invalid choice: 'yes'"),
    ],
)
def test_bad_arguments_stop_before_any_row(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_phase_labels_its_calls_and_runs_its_exit_hook_once(monkeypatch):
    """``DeviceMemory.phase``: the label while the call runs (the previous one back after, an exception too), and
    the hook that reads the allocator history after the phase's first call only (the sampling thread, CUDA-only,
    is not started here; PyTorch's peak counters are stubbed)."""
    import torch
    from rl_step import DeviceMemory

    for fn in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, fn, lambda: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    mem = DeviceMemory.__new__(DeviceMemory)
    mem.label, mem.torch_peaks, seen, hooked = "training", {}, [], []
    mem.on_exit = {"scoring": lambda: hooked.append(mem.label)}
    scoring = mem.phase("scoring", lambda x: seen.append((x, mem.label)) or x)
    assert scoring(1) == 1 and scoring(2) == 2
    assert seen == [(1, "scoring"), (2, "scoring")] and hooked == ["training"] and mem.label == "training"

    def boom():
        raise RuntimeError("engine")

    mem.on_exit["generation"] = lambda: hooked.append("read")
    with pytest.raises(RuntimeError, match="engine"):
        mem.phase("generation", boom)()
    assert mem.label == "training" and hooked == ["training"]  # a call that raised runs no hook


def test_the_training_profile_covers_the_loss_passes_of_the_extra_step_only():
    """``StepTimes`` with ``profile_step=2`` as the trainer calls its callback (8 micro-batches per optimiser step:
    a sub-step end after each but the last, then the step end): the profile holds step 2's micro-batches 2..8 and
    nothing of step 1 or of step 2's first micro-batch, and each step's pass window counts the same 7;
    ``_profiled_step`` keeps that step out of the timed ones."""
    import argparse
    import types

    import torch
    from rl_step import StepTimes, _profiled_step

    times = StepTimes({}, profile_step=2, dev="cpu")
    cb, state = times.callback, types.SimpleNamespace(global_step=0)
    x = torch.ones(64, 64)
    for step, first_op, rest_op in ((1, torch.mm, torch.mm), (2, torch.sub, torch.add)):
        cb.on_step_begin(None, state, None)
        for micro in range(8):
            (first_op if micro == 0 else rest_op)(x, x)
            if micro < 7:
                cb.on_substep_end(None, state, None)
        state.global_step = step
        cb.on_step_end(None, state, None)
    names = {r["name"] for r in times.profile["top_cpu"]}
    assert times.profile["micro_batches"] == 7 and "aten::add" in names
    assert not names & {"aten::mm", "aten::sub"}
    assert [s["passes"]["micro_batches"] for s in times.steps] == [7, 7]
    steps = [{"step_s": 1.0}, {"step_s": 2.0}, {"step_s": 9.0}]
    kept, extra = _profiled_step(steps, times, argparse.Namespace(profile_training=True, steps=2))
    assert kept == steps[:2] and extra["step"] == {"step_s": 9.0} and extra["micro_batches"] == 7
    assert _profiled_step(steps, times, argparse.Namespace(profile_training=False, steps=3)) == (steps, None)


def test_pytorchs_peaks_are_folded_into_the_phase_that_made_them(monkeypatch):
    """PyTorch's peak counters are read and reset on each change of phase (never from the sampling thread, which
    deadlocked vLLM's pool allocator): each phase keeps the largest peak of its own stretches, the whole row's
    reserved peak is the largest of them."""
    import torch
    from rl_step import DeviceMemory

    counters = {"allocated": 0, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: counters["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: counters.update(allocated=0, reserved=0))

    def use(allocated, reserved):
        counters.update(allocated=max(counters["allocated"], allocated), reserved=max(counters["reserved"], reserved))

    mem = DeviceMemory.__new__(DeviceMemory)
    mem.label, mem.torch_peaks, mem.on_exit = "setup", {}, {}
    use(2 * 2**30, 3 * 2**30)  # setup
    mem.switch("training")
    use(2**30, 2**30)
    scoring = mem.phase("scoring", lambda: use(5 * 2**30, 6 * 2**30))
    scoring()
    use(2**30, 4 * 2**30)  # training again, after the scoring pass
    scoring()
    mem.switch("training")  # what stop() does at the end
    assert mem.phase_torch_peaks() == {
        "setup": {"allocated": 2.0, "reserved": 3.0},
        "training": {"allocated": 1.0, "reserved": 4.0},
        "scoring": {"allocated": 5.0, "reserved": 6.0},
    }
    assert mem.torch_max_reserved() == 6.0


def test_the_pass_window_tells_the_main_threads_cpu_from_another_threads_and_counts_full_collections():
    """``PassWindow`` over a stretch where the main thread spins, another (labelled) thread spins, and one full
    collection runs: each thread's CPU seconds land on its side, the collection is counted, and a window that never
    began gives None."""
    import gc
    import threading
    import time

    from rl_step import PassWindow, thread_cpu_s

    if not thread_cpu_s():
        pytest.skip("no /proc/self/task here")

    spun, release, ids = threading.Event(), threading.Event(), []

    def busy_other():  # spins, then stays alive until the window has closed (a thread that ends takes its counts)
        ids.append(threading.get_native_id())
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()

    labels = {}
    w = PassWindow(labels)
    assert w.end() is None
    w.begin()
    t = threading.Thread(target=busy_other)
    t.start()
    spun.wait()
    labels[ids[0]] = "busy-other"  # as DeviceMemory.labels() names its sampling thread
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
    gc.collect()
    got = w.end()
    release.set()
    t.join()
    assert got["main_cpu_s"] >= 0.25 and got["other_cpu_s"] >= 0.35
    assert got["busiest_others"][0] == ["busy-other", got["busiest_others"][0][1]]
    assert got["busiest_others"][0][1] >= 0.35 and got["gc_full"] >= 1 and got["gc_s"] > 0
    assert got["wall_s"] >= got["main_cpu_s"] - 0.05
    assert w.end() is None  # the window closed
