"""NaN/inf and out-of-memory guards (grpo_kit.trainer.guards) on tiny models, CPU.

A non-finite term is injected into a micro-batch (NaN advantage for one sample): the update is skipped
(weights bit-identical across that step), guard_events.jsonl names the term and the sample, and
max_bad_steps bad steps in a row stop training with the state saved. OOM is simulated by raising
``torch.cuda.OutOfMemoryError`` inside the loss (the guard catches it on any device): the halved retry
gives the same loss and weights as the whole micro-batch; a second OOM stops with a message naming the
settings and the VRAM calculator's estimate.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.loss.objective import LOSS_TYPES
from grpo_kit.loss.reference import grpo_loss_reference
from grpo_kit.model.loading import load_model
from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
from grpo_kit.tasks.rewards import completion_text
from grpo_kit.trainer.channel import channel
from grpo_kit.trainer.checkpoints import list_checkpoints, verify_checkpoint
from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer
from grpo_kit.trainer.guards import (
    NonFiniteStop,
    OutOfMemoryStop,
    _split_batch,
    configure_reliability,
    split_weights,
    with_reliability,
)

WORKER = Path(__file__).resolve().parent / "_resume_worker.py"
TRAINERS = {"grpo_kit": EfficientGRPOTrainer, "trl": GRPOTrainer}


def _reward(prompts, completions, **kw):  # dense and varied, so advantages are non-zero from step 1
    return [float(sum(map(ord, completion_text(c))) % 7) / 7 for c in completions]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


class _WeightWatch(TrainerCallback):
    """Whether the trainable weights changed in each optimiser step."""

    def __init__(self, model):
        self.model, self.changed, self._before = model, {}, None

    def _trainable(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def on_step_begin(self, args, state, control, **kw):
        self._before = self._trainable()

    def on_step_end(self, args, state, control, **kw):
        after = self._trainable()
        self.changed[state.global_step] = any(not torch.equal(after[n], self._before[n]) for n in after)


def _make(tiny, tmp_path, trainer="grpo_kit", max_steps=6, max_bad_steps=2, loss_type="grpo", **kw):
    model, tok = tiny
    tok.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        beta=0.04,
        loss_type=loss_type,
        report_to="none",
        use_cpu=True,
        max_steps=max_steps,
        temperature=0.7,
        use_bias_correction_kl=False,
        bf16=False,
        learning_rate=5e-3,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    t = with_reliability(TRAINERS[trainer])(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=args,
        processing_class=tok,
        peft_config=lora,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 32, seed=0)),
    )
    cfg = GRPOKitConfig(
        model="tiny-llama",
        trainer=trainer,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_bad_steps=max_bad_steps,
        loss_type=loss_type,
    )
    configure_reliability(t, cfg)
    t.watch = _WeightWatch(t.model)
    t.add_callback(t.watch)
    return t


def _inject_nan_advantage(trainer, bad_steps, sample=1):
    """The micro-batch of each step in ``bad_steps`` gets a NaN advantage for ``sample`` (the buffer is untouched)."""
    prepare = trainer._prepare_inputs

    def prepared(batch):
        out = prepare(batch)
        if trainer.state.global_step + 1 in bad_steps:
            out = dict(out)
            out["advantages"] = out["advantages"].clone()
            out["advantages"][sample] = float("nan")
        return out

    trainer._prepare_inputs = prepared


def _events(trainer):
    path = Path(trainer.args.output_dir) / "guard_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("trainer_name", ["grpo_kit", "trl"])
def test_nan_step_skipped_logged_and_stop_after_max_bad_steps(tiny, tmp_path, trainer_name, capsys):
    t = _make(tiny, tmp_path, trainer=trainer_name, max_steps=6, max_bad_steps=2)
    _inject_nan_advantage(t, bad_steps={2, 4, 5})
    t.train()
    # Step 2 alone is skipped and training goes on; 4 and 5 in a row reach max_bad_steps=2: stop after 5.
    assert t.watch.changed == {1: True, 2: False, 3: True, 4: False, 5: False}
    assert t.state.global_step == 5
    assert isinstance(channel(t).stop_error, NonFiniteStop) and "max_bad_steps=2" in str(channel(t).stop_error)
    assert t.guard_counts["bad_steps"] == 3
    events = _events(t)
    assert [e["step"] for e in events] == [2, 4, 5] and [e["consecutive"] for e in events] == [1, 1, 2]
    for e in events:
        assert e["event"] == "nonfinite" and "advantages (samples [1])" in e["message"]
        (report,) = e["reports"]
        assert report["terms"]["advantages"] == [1] and "1" in report["samples"]  # the sample's decoded text
    assert "update skipped" in capsys.readouterr().err
    # The state was saved at the stop, as a complete checkpoint.
    (ckpt,) = list_checkpoints(t.args.output_dir)
    assert ckpt.name == "checkpoint-5" and verify_checkpoint(ckpt) is None
    assert str(ckpt) in str(channel(t).stop_error)


def test_real_value_error_is_not_swallowed(tiny, tmp_path):
    """A ValueError of the loss with every input finite is a bug, not a bad step: it propagates."""
    t = _make(tiny, tmp_path, max_steps=2)

    def broken(model, inputs):
        raise ValueError("some other problem")

    t._compute_loss = broken
    with pytest.raises(ValueError, match="some other problem"):
        t.train()


def test_cli_nan_stops_with_one_line_exit_1(tmp_path, repo_root):
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            str(WORKER),
            "train",
            "--set",
            "model=tiny-llama",
            "--set",
            "max_steps=6",
            "--set",
            "save_steps=2",
            "--set",
            "max_bad_steps=2",
            "--set",
            "num_train_samples=16",
            "--set",
            "num_eval_samples=0",
            "--set",
            "max_completion_length=8",
            "--set",
            "num_generations=4",
            "--set",
            "per_device_train_batch_size=4",
            "--output-dir",
            str(out),
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GRPO_KIT_TEST_NAN_ADVANTAGE_FROM_STEP": "3"},
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training stopped at step 4" in errors[0] and "max_bad_steps=2" in errors[0]
    events = [json.loads(x) for x in (out / "guard_events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [3, 4] and all("advantages" in e["message"] for e in events)
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()  # what was trained is kept


# ---------------------------------------------------------------------------------------------------
# out of memory
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_split_weights_reproduce_the_whole_micro_batch_loss(loss_type, level):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    full = {
        "completion_ids": torch.randint(0, 50, (B, T), generator=g),
        "completion_mask": (torch.arange(T)[None] < torch.tensor([[9], [4], [1], [7], [9], [2]])).long(),
        "advantages": torch.randn(B, generator=g),
    }
    logps, old, ref = (-torch.rand(B, T, generator=g) * 3 for _ in range(3))
    full.update(logps=logps, old=old, ref=ref)
    kw = dict(
        beta=0.04,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        max_completion_length=T,
        num_items_in_batch=float(full["completion_mask"].sum()),
        importance_sampling_level=level,
    )

    def loss(b):
        return grpo_loss_reference(b["logps"], b["old"], b["ref"], b["advantages"], b["completion_mask"], **kw)[0]

    halves = _split_batch(full, 2)
    assert [h["completion_ids"].size(0) for h in halves] == [3, 3]
    weights = split_weights(halves, full, loss_type)
    torch.testing.assert_close(sum(w * loss(h) for w, h in zip(weights, halves)), loss(full), rtol=1e-6, atol=1e-7)


class _OOMOnce:
    """Raise torch.cuda.OutOfMemoryError in the loss of the given steps (``times`` calls in a row)."""

    def __init__(self, trainer, step, times=1):
        self.trainer, self.step, self.left, self.raised = trainer, step, times, 0
        self.inner = type(trainer)._compute_loss

    def __call__(self, model, inputs):
        if self.trainer.state.global_step + 1 == self.step and self.left > 0:
            self.left -= 1
            self.raised += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return self.inner(self.trainer, model, inputs)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


@pytest.mark.parametrize(
    "trainer_name,setting", [("grpo_kit", "loss_chunk_size"), ("trl", "per_device_train_batch_size")]
)
def test_oom_halves_once_and_retries_with_the_same_result(tiny, tmp_path, trainer_name, setting):
    ref = _make(tiny, tmp_path / "ref", trainer=trainer_name, max_steps=2)
    ref.train()
    t = _make(tiny, tmp_path / "oom", trainer=trainer_name, max_steps=2)
    oom = _OOMOnce(t, step=1)  # step 2 then runs with the halved setting
    t._compute_loss = oom
    t.train()
    assert oom.raised == 1 and t.guard_counts["oom_retries"] == 1 and channel(t).stop_error is None
    (event,) = _events(t)
    assert event["event"] == "oom" and event["setting"] == setting and event["step"] == 1
    assert event["new"] == max(1, event["old"] // 2)
    # Same completions (no new generation for the retry), same loss and weights up to float rounding.
    print(
        f"{trainer_name}: losses {_losses(t)} vs unhalved {_losses(ref)}; grad norms "
        f"{[h['grad_norm'] for h in t.state.log_history if 'grad_norm' in h]} vs "
        f"{[h['grad_norm'] for h in ref.state.log_history if 'grad_norm' in h]}; max weight difference "
        f"{max(float((p - q).abs().max()) for p, q in zip(t.model.parameters(), ref.model.parameters())):.3g}"
    )
    torch.testing.assert_close(torch.tensor(_losses(t)), torch.tensor(_losses(ref)), rtol=1e-4, atol=1e-7)
    # The loss of a GRPO step at ratio 1 is ~0 by construction; the gradient norm is the telling figure.
    norms = [[h["grad_norm"] for h in x.state.log_history if "grad_norm" in h] for x in (t, ref)]
    assert len(norms[0]) == 2 and min(norms[1]) > 0.01
    torch.testing.assert_close(torch.tensor(norms[0]), torch.tensor(norms[1]), rtol=1e-4, atol=0)
    for (n, p), (_, q) in zip(t.model.named_parameters(), ref.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)
    assert [h.get("reward") for h in t.state.log_history[:2]] == [h.get("reward") for h in ref.state.log_history[:2]]
    assert all(t.watch.changed.values()) and len(_losses(t)) == 2


@pytest.mark.parametrize(
    "trainer_name,setting", [("grpo_kit", "loss_chunk_size"), ("trl", "per_device_train_batch_size")]
)
def test_second_oom_stops_naming_the_setting_and_estimate(tiny, tmp_path, trainer_name, setting):
    t = _make(tiny, tmp_path, trainer=trainer_name, max_steps=2)
    t._compute_loss = _OOMOnce(t, step=2, times=2)
    with pytest.raises(OutOfMemoryStop) as info:
        t.train()
    msg = str(info.value)
    assert setting in msg and "per_device_train_batch_size" in msg and "already halved once" in msg
    assert "VRAM calculator estimates" in msg and "GiB peak" in msg
    assert "scoring_batch_size" not in msg  # not set: nothing to lower there
    assert "simulated" in msg  # the original error
    # State saved as at the start of step 2: step 1's weights, resumable.
    (ckpt,) = list_checkpoints(t.args.output_dir)
    assert ckpt.name == "checkpoint-1" and verify_checkpoint(ckpt) is None
    assert str(ckpt) in msg


def test_reliable_trainers_are_composed_at_class_definition(tiny, tmp_path):
    """make_trainer(reliable=True) builds the guarded, resumable class directly (one class per base, cached);
    configuring it changes no class, and a trainer built without them is refused with the reason."""
    from grpo_kit.trainer.checkpoints import ResumableTrainerMixin
    from grpo_kit.trainer.grpo_trainer import make_trainer

    model, tok = tiny
    cfg = GRPOKitConfig(
        model="tiny-llama", num_generations=4, per_device_train_batch_size=4, max_completion_length=4, max_bad_steps=5
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        report_to="none",
        use_cpu=True,
        max_steps=1,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    kw = dict(
        model=copy.deepcopy(model),
        tokenizer=tok,
        reward_funcs=[_reward],
        args=args,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"),
    )
    t = make_trainer(cfg, reliable=True, **kw)
    cls = type(t)
    assert isinstance(t, (EfficientGRPOTrainer,)) and issubclass(cls, ResumableTrainerMixin)
    assert cls is with_reliability(EfficientGRPOTrainer) and with_reliability(cls) is cls
    configure_reliability(t, cfg)
    assert type(t) is cls and t.max_bad_steps == 5 and channel(t).stop_error is None
    plain = make_trainer(cfg, **{**kw, "model": copy.deepcopy(model)})
    with pytest.raises(TypeError, match="has no guards: build it from with_reliability"):
        configure_reliability(plain, cfg)


def test_an_oom_stop_names_a_scoring_batch_size_that_is_set(tiny, tmp_path):
    """With ``scoring_batch_size`` set, the no-grad scoring pass may be what ran out: the stop names it (a setting
    that may be changed on resume)."""
    from grpo_kit.app.resume_policy import SAFE_RESUME_OVERRIDES

    t = _make(tiny, tmp_path, trainer="grpo_kit", max_steps=2)
    t.scoring_batch_size = 4  # as the config's default, 'auto', could resolve
    t._compute_loss = _OOMOnce(t, step=2, times=2)
    with pytest.raises(
        OutOfMemoryStop,
        match=r"scoring_batch_size \(now 4, chosen by 'auto'; null scores "
        r"per_device_train_batch_size",
    ):
        t.train()
    assert "scoring_batch_size" in SAFE_RESUME_OVERRIDES
