"""EfficientGRPOTrainer: parity with stock TRL on a fixed batch, training runs, TRL drift guard."""

import copy
import inspect

import pytest
import torch
import trl
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from grpo_kit.data import generate_tasks, to_prompt_dataset
from grpo_kit.models import load_model
from grpo_kit.rewards import completion_text, correctness_reward, format_soft_reward
from grpo_kit.trainer import EfficientGRPOTrainer

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def _args(tmp_path, loss_type, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=8, beta=0.04, loss_type=loss_type, report_to="none", use_cpu=True,
                max_steps=2, temperature=0.7, use_bias_correction_kl=False, bf16=False, learning_rate=5e-3,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
    base.update(kw)
    return GRPOConfig(**base)


def _lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], task_type="CAUSAL_LM")


def _reward(prompts, completions, **kw):  # dense and varied, so advantages are non-zero from step 1
    return [float(sum(map(ord, completion_text(c))) % 7) / 7 for c in completions]


@pytest.fixture(scope="module")
def tiny():
    return {name: load_model(name) for name in ("tiny-llama", "tiny-qwen2")}


@pytest.mark.parametrize("is_ratio", [None, "token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_grads_equal_stock_trl_on_fixed_batch(tiny, tmp_path, loss_type, is_ratio):
    """is_ratio: TRL's importance-sampling correction on (``use_vllm``, as the kit's generation mixin
    sets it for vLLM), with a per-token (B, C) or per-sequence (B, 1) ``importance_sampling_ratio``."""
    model, tok = tiny["tiny-llama"]
    tok.padding_side = "left"
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0))
    trainers = []
    for cls in (GRPOTrainer, EfficientGRPOTrainer):
        trainers.append(cls(model=copy.deepcopy(model), reward_funcs=[correctness_reward], args=_args(tmp_path, loss_type),
                            train_dataset=ds, processing_class=tok, peft_config=_lora()))
    stock, ours = trainers
    gen = torch.Generator().manual_seed(1)
    for (_, p1), (_, p2) in zip(stock.model.named_parameters(), ours.model.named_parameters()):
        if p1.requires_grad:  # non-zero LoRA B so the adapter matters
            v = torch.randn(p1.shape, generator=gen) * 0.05
            p1.data.copy_(v), p2.data.copy_(v)
    B, P, C = 4, 6, 8
    inputs = dict(prompt_ids=torch.randint(3, 1000, (B, P), generator=gen), prompt_mask=torch.ones(B, P, dtype=torch.long),
                  completion_ids=torch.randint(3, 1000, (B, C), generator=gen),
                  completion_mask=(torch.arange(C)[None] < torch.tensor([[8], [5], [3], [7]])).long(),
                  advantages=torch.randn(B, generator=gen), num_items_in_batch=torch.tensor(23.0))
    inputs["prompt_mask"][0, :2] = 0  # left padding
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    cm = inputs["completion_mask"].bool()
    with torch.no_grad():
        with stock.model.disable_adapter():
            ref_stock = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C)[0]
        with ours.model.disable_adapter():
            ref_ours = ours._get_per_token_logps_and_entropies(ours.model, ids, am, C)[0]
    torch.testing.assert_close(ref_ours[cm], ref_stock[cm], rtol=1e-5, atol=1e-5)
    inputs["ref_per_token_logps"] = ref_stock
    inputs["old_per_token_logps"] = ref_stock + 0.1 * torch.randn(B, C, generator=gen)  # exercise clipping
    for t in trainers:
        t.current_gradient_accumulation_steps = 2
        t.args.steps_per_generation = 2
    if is_ratio is not None:
        ratio = torch.exp(0.3 * torch.randn((B, C) if is_ratio == "token" else (B, 1), generator=gen))
        ratio[ratio > 1.5] = 0.0  # TRL's *_mask modes zero out ratios beyond the clip
        inputs["importance_sampling_ratio"] = ratio
        for t in trainers:
            t.use_vllm = True  # what KitGenerationMixin sets; TRL's _compute_loss then applies the ratio
            assert t.vllm_importance_sampling_correction
        unweighted = ours._compute_loss(ours.model, {k: v for k, v in inputs.items()
                                                     if k != "importance_sampling_ratio"} | {
                                            "importance_sampling_ratio": torch.ones_like(ratio)})
        ours.model.zero_grad(set_to_none=True)
    loss_stock = stock._compute_loss(stock.model, inputs)
    loss_ours = ours._compute_loss(ours.model, inputs)
    torch.testing.assert_close(loss_ours, loss_stock, rtol=1e-5, atol=1e-7)
    if is_ratio is not None:  # the ratio really changed the loss (else the comparison proves nothing)
        assert abs(unweighted.item() - loss_ours.item()) > 1e-3 * abs(loss_ours.item())
    loss_stock.backward(), loss_ours.backward()
    checked = 0
    for (n, p1), (_, p2) in zip(stock.model.named_parameters(), ours.model.named_parameters()):
        if p1.requires_grad:
            torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-6, msg=n)
            checked += 1
    assert checked > 0
    for key in ("kl", "clip_ratio/region_mean", "entropy"):
        assert ours._metrics["train"][key], key


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_step_training_changes_lora_keeps_base(tiny, tmp_path, name, loss_type):
    model, tok = tiny[name]
    tok.padding_side = "left"
    trainer = EfficientGRPOTrainer(model=copy.deepcopy(model), reward_funcs=[_reward, format_soft_reward],
                                   args=_args(tmp_path, loss_type), train_dataset=to_prompt_dataset(
                                       generate_tasks("arithmetic", 16, seed=0)), processing_class=tok,
                                   peft_config=_lora())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and set(changed) == set(trainable)
    frozen_changed = [n for n, p in trainer.model.named_parameters()
                      if not p.requires_grad and not torch.equal(p, before[n])]
    assert frozen_changed == []
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


def test_unsupported_settings_fail_at_construction(tiny, tmp_path):
    model, tok = tiny["tiny-llama"]
    with pytest.raises(ValueError, match="loss_type='cispo'"):
        EfficientGRPOTrainer(model=model, reward_funcs=[_reward], args=_args(tmp_path, "cispo"),
                             train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 4)), processing_class=tok)
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        EfficientGRPOTrainer(model=model, reward_funcs=[_reward], args=_args(tmp_path, "grpo", use_bias_correction_kl=True),
                             train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 4)), processing_class=tok)


# --- drift guard: what the subclass relies on in the pinned TRL ---------------------------

def test_trl_is_the_pinned_version():
    assert trl.__version__ == "1.16.0", (
        f"TRL {trl.__version__} is not the pinned 1.16.0: re-check EfficientGRPOTrainer's overrides "
        "(_get_per_token_logps_and_entropies, _compute_loss) against the new GRPOTrainer, then update the pin")


def test_overridden_methods_keep_their_signatures():
    sig = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
    assert list(sig.parameters)[:7] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                        "batch_size", "compute_entropy"]
    assert "compute_aux_loss" in sig.parameters
    assert list(inspect.signature(GRPOTrainer._compute_loss).parameters) == ["self", "model", "inputs"]
    assert list(inspect.signature(GRPOTrainer.compute_loss).parameters)[:3] == ["self", "model", "inputs"]


def test_trl_loss_still_reads_what_we_feed_it():
    """Behavioural drift: TRL's loss must still take these inputs and normalise as we mirror."""
    src = inspect.getsource(GRPOTrainer._compute_loss)
    for needle in ('inputs["prompt_ids"]', 'inputs["completion_ids"]', 'inputs["advantages"]',
                   'inputs.get("old_per_token_logps")', 'inputs["ref_per_token_logps"]',
                   'inputs["num_items_in_batch"]', "self.current_gradient_accumulation_steps",
                   "self.args.steps_per_generation", "self.accelerator.num_processes",
                   "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1",
                   'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]',
                   "if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type"):
        assert needle in src, f"TRL's _compute_loss no longer contains {needle!r}"
    gen_src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "_get_per_token_logps_and_entropies" in gen_src  # ref/old passes still go through our override
    assert "disable_adapter" in inspect.getsource(trl.trainer.grpo_trainer) or "use_adapter" in gen_src
