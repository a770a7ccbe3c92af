"""Subprocess for tests/test_resume.py: ``python -m grpo_kit`` with a reward that varies on random text.

The tiny random models never produce a correct answer, so the built-in rewards are all 0, the advantages
too, and nothing would train. This worker swaps in a deterministic reward of the completion text (a
function of its characters) so that every step changes the weights; the rest is the real CLI.

``GRPO_KIT_TEST_PAUSE_AT_SAVE=STEP``: the write of checkpoint-STEP pauses (120 s) once its files are in
the ``.tmp-checkpoint-STEP-*`` folder, before its manifest and rename, and says so in
``checkpoints/SAVE_PAUSED``, so a test can SIGKILL the process in the middle of a checkpoint write
(the math of the run is not affected).

``GRPO_KIT_TEST_NAN_ADVANTAGE_FROM_STEP=N``: from optimiser step N on, sample 1 of each micro-batch gets
a NaN advantage (for the NaN guard's CLI test).
"""

import os
import sys
import time
from pathlib import Path


def char_reward(prompts, completions, **kwargs):
    """(sum of character codes mod 7) / 6: arbitrary but deterministic, different across completions."""
    from grpo_kit.tasks.rewards import completion_text

    return [(sum(map(ord, completion_text(c))) % 7) / 6.0 for c in completions]


def _install_test_hooks():
    """Everything here changes process-wide state, so it runs only when this file is the program
    (pytest's --doctest-modules imports every module under tests/: a module-level
    ``sys.modules["vllm"] = None`` once made the whole suite skip its vLLM tests)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    # The tiny random-weight models always generate with HF (no checkpoint folder for vLLM); hiding an
    # installed vLLM only saves TRL's import of it (seconds per process). The tests start several runs at
    # once on a small machine: one thread each (same results, computed in the same order).
    sys.modules["vllm"] = None
    import torch

    torch.set_num_threads(1)

    import grpo_kit.app.run as run

    run.get_reward_funcs = lambda names: [char_reward]

    pause_at = os.environ.get("GRPO_KIT_TEST_PAUSE_AT_SAVE")
    if pause_at:
        import grpo_kit.trainer.checkpoints as resume_mod

        write_manifest = resume_mod.write_manifest

        def paused_manifest(folder):
            if folder.name.startswith(f".tmp-checkpoint-{pause_at}-"):
                (folder.parent / "SAVE_PAUSED").write_text(folder.name)  # tells the test the files are there
                time.sleep(120)
            write_manifest(folder)

        resume_mod.write_manifest = paused_manifest

    nan_from = os.environ.get("GRPO_KIT_TEST_NAN_ADVANTAGE_FROM_STEP")
    if nan_from:  # for tests/test_guards.py: sample 1 of every micro-batch from that step on gets a NaN advantage
        from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

        prepare = EfficientGRPOTrainer._prepare_inputs

        def nan_prepare(self, batch):
            out = prepare(self, batch)
            if self.model.training and self.state.global_step + 1 >= int(nan_from):
                out = dict(out)
                out["advantages"] = out["advantages"].clone()
                out["advantages"][1] = float("nan")
            return out

        EfficientGRPOTrainer._prepare_inputs = nan_prepare


if __name__ == "__main__":
    _install_test_hooks()
    from grpo_kit.app.cli import main

    sys.exit(main(sys.argv[1:]))
