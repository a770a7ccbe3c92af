"""EfficientGRPOTrainer: parity with stock TRL on a fixed batch, training runs, TRL drift guard."""

import copy
import inspect
import re

import pytest
import torch
import trl
from _objective_settings import SETTINGS, loss_kwargs
from _parity import check_reference_and_fill
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from grpo_kit.model.loading import load_model
from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
from grpo_kit.tasks.rewards import completion_text, correctness_reward, format_soft_reward
from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

TRAIN_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def _args(tmp_path, loss_type=None, **kw):
    """Small-run GRPOConfig; ``loss_type=None`` leaves every objective option at TRL's default."""
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        max_steps=2,
        temperature=0.7,
        bf16=False,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    if loss_type is not None:
        base.update(beta=0.04, loss_type=loss_type, use_bias_correction_kl=False)
    base.update(kw)
    return GRPOConfig(**base)


def _setting_args(tmp_path, setting):
    """GRPOConfig of a parity setting (tests/_objective_settings.py); ``trl_default`` passes nothing."""
    if setting == "trl_default":
        return _args(tmp_path)
    kw = loss_kwargs(setting)
    kw["epsilon"] = kw.pop("epsilon_low")
    return _args(tmp_path, **kw)


def _lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], task_type="CAUSAL_LM")


def _reward(prompts, completions, **kw):  # dense and varied, so advantages are non-zero from step 1
    return [float(sum(map(ord, completion_text(c))) % 7) / 7 for c in completions]


@pytest.fixture(scope="module")
def tiny():
    return {name: load_model(name) for name in ("tiny-llama", "tiny-qwen2")}


def _assert_same_lora_grads(stock, ours, loss_stock, loss_ours):
    """Backward both losses; every trainable (LoRA) gradient equal."""
    loss_stock.backward(), loss_ours.backward()
    checked = 0
    for (n, p1), (_, p2) in zip(stock.model.named_parameters(), ours.model.named_parameters()):
        if p1.requires_grad:
            torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-6, msg=n)
            checked += 1
    assert checked > 0


def _stock_and_ours(model, tok, args_pair, seed):
    """Stock TRL and the kit's trainer on copies of ``model`` with the same random non-zero LoRA, and a fixed
    batch: (stock, ours, generator, inputs, ids, attention mask)."""
    tok.padding_side = "left"
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0))
    stock, ours = (
        cls(
            model=copy.deepcopy(model),
            reward_funcs=[correctness_reward],
            args=a,
            train_dataset=ds,
            processing_class=tok,
            peft_config=_lora(),
        )
        for cls, a in zip((GRPOTrainer, EfficientGRPOTrainer), args_pair)
    )
    gen = torch.Generator().manual_seed(seed)
    for (_, p1), (_, p2) in zip(stock.model.named_parameters(), ours.model.named_parameters()):
        if p1.requires_grad:  # non-zero LoRA B so the adapter matters
            v = torch.randn(p1.shape, generator=gen) * 0.05
            p1.data.copy_(v), p2.data.copy_(v)
    B, P, C = 4, 6, 8
    inputs = dict(
        prompt_ids=torch.randint(3, 1000, (B, P), generator=gen),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        completion_ids=torch.randint(3, 1000, (B, C), generator=gen),
        completion_mask=(torch.arange(C)[None] < torch.tensor([[8], [5], [3], [7]])).long(),
        advantages=torch.randn(B, generator=gen),
        num_items_in_batch=torch.tensor(23.0),
    )
    inputs["prompt_mask"][0, :2] = 0  # left padding
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    return stock, ours, gen, inputs, ids, am


@pytest.mark.parametrize(
    "setting,is_ratio",
    [(s, r) for s in SETTINGS for r in (None, "token")]
    + [(s, "sequence") for s in ("grpo", "gspo", "cispo", "trl_default")],
)  # TRL refuses VESPO with (B, 1) ratios
def test_loss_and_grads_equal_stock_trl_on_fixed_batch(tiny, tmp_path, setting, is_ratio):
    """Every objective setting, TRL's default config included. is_ratio: TRL's importance-sampling
    correction on (``use_vllm``, as the kit's generation mixin sets it for vLLM), with a per-token
    (B, C) or per-sequence (B, 1) ``importance_sampling_ratio`` (TRL refuses the latter for VESPO)."""
    model, tok = tiny["tiny-llama"]
    stock, ours, gen, inputs, ids, am = _stock_and_ours(
        model, tok, [_setting_args(tmp_path, setting) for _ in range(2)], seed=1
    )
    trainers = (stock, ours)
    B, C = inputs["completion_ids"].shape
    cm = inputs["completion_mask"].bool()
    check_reference_and_fill(stock, ours, inputs, gen)
    if is_ratio is not None:
        ratio = torch.exp(0.3 * torch.randn((B, C) if is_ratio == "token" else (B, 1), generator=gen))
        ratio[ratio > 1.5] = 0.0  # TRL's *_mask modes zero out ratios beyond the clip
        if is_ratio == "token":  # TRL's ratio is exp(0) = 1 at padding (VESPO sums its log over all of T)
            ratio = torch.where(cm, ratio, 1.0)
        inputs["importance_sampling_ratio"] = ratio
        for t in trainers:
            t.use_vllm = True  # what KitGenerationMixin sets; TRL's _compute_loss then applies the ratio
            assert t.vllm_importance_sampling_correction
        unweighted = ours._compute_loss(
            ours.model,
            {k: v for k, v in inputs.items() if k != "importance_sampling_ratio"}
            | {"importance_sampling_ratio": torch.ones_like(ratio)},
        )
        ours.model.zero_grad(set_to_none=True)
    loss_stock = stock._compute_loss(stock.model, inputs)
    loss_ours = ours._compute_loss(ours.model, inputs)
    torch.testing.assert_close(loss_ours, loss_stock, rtol=1e-5, atol=1e-7)
    if is_ratio is not None:  # the ratio really changed the loss (else the comparison proves nothing)
        assert abs(unweighted.item() - loss_ours.item()) > 1e-3 * abs(loss_ours.item())
    _assert_same_lora_grads(stock, ours, loss_stock, loss_ours)
    stock_logged = {k for k, v in stock._metrics["train"].items() if v}
    ours_logged = {k for k, v in ours._metrics["train"].items() if v}
    assert stock_logged <= ours_logged, stock_logged - ours_logged
    for k in stock_logged:  # one process: the same numbers
        assert ours._metrics["train"][k][-1] == pytest.approx(
            stock._metrics["train"][k][-1], rel=1e-4, abs=1e-6, nan_ok=True
        ), k


@pytest.mark.parametrize("setting", ["trl_default", "grpo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_engine_ratio_in_the_loss_equals_trls_old_policy_pass(tiny, tmp_path, setting, mode):
    """Generation aligned with the optimiser step (TRL's own condition): the kit skips TRL's old-policy pass and its
    loss forms the engine's importance ratio from the current log-probs. Against stock TRL fed its own old-policy
    pass and the ratio as TRL forms it (its lines, copied): the same loss, LoRA gradients and sampling metrics."""
    from test_loss import _trl_engine_ratio

    model, tok = tiny["tiny-llama"]
    args = [_setting_args(tmp_path, setting) for _ in range(2)]
    for a in args:
        a.vllm_importance_sampling_mode, a.vllm_importance_sampling_clip_min = (
            mode,
            0.95 if "truncate" in mode else None,
        )
        a.vllm_importance_sampling_clip_max = 1.05 if "truncate" in mode else 1.1
    stock, ours, gen, inputs, ids, am = _stock_and_ours(model, tok, args, seed=3)
    B, C = inputs["completion_ids"].shape
    with torch.no_grad():
        old = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C)[0]  # TRL's old-policy pass
        with stock.model.disable_adapter():
            inputs["ref_per_token_logps"] = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C)[0]
    inputs["sampling_per_token_logps"] = old + 0.1 * torch.randn(B, C, generator=gen)  # the engine's view
    inputs["sampling_per_token_logps"][1, 0] = float("nan")  # a token the engine could not score
    for t in (stock, ours):
        t.use_vllm = True  # what KitGenerationMixin sets
        t.current_gradient_accumulation_steps = 2
        t.args.steps_per_generation = t.args.gradient_accumulation_steps = 2
    clip = (args[0].vllm_importance_sampling_clip_min, args[0].vllm_importance_sampling_clip_max)
    assert ours._engine_ratio_in_loss() and ours._engine_correction(inputs) == (mode, *clip)
    ratio = _trl_engine_ratio(old, inputs["sampling_per_token_logps"], inputs["completion_mask"], mode, *clip)
    bitten = (ratio == 0) | (ratio == clip[1]) | ((ratio == clip[0]) if clip[0] is not None else False)
    assert bitten.any(), "the bounds never bite: the test would be weak"
    loss_stock = stock._compute_loss(
        stock.model, {**inputs, "old_per_token_logps": old, "importance_sampling_ratio": ratio}
    )
    loss_ours = ours._compute_loss(ours.model, inputs)
    torch.testing.assert_close(loss_ours, loss_stock, rtol=1e-5, atol=1e-7)
    _assert_same_lora_grads(stock, ours, loss_stock, loss_ours)
    flat = ratio.flatten() if ratio.shape[-1] == 1 else ratio[inputs["completion_mask"].bool()]
    logged = ours._metrics["train"]
    assert logged["sampling/importance_sampling_ratio/mean"][-1] == pytest.approx(flat.mean().item(), rel=1e-5)
    assert logged["sampling/importance_sampling_ratio/min"][-1] == pytest.approx(flat.min().item(), rel=1e-5)
    ours.args.gradient_accumulation_steps = 3  # misaligned: TRL's own old-policy pass and ratio again
    assert not ours._engine_ratio_in_loss() and ours._engine_correction(inputs) is None


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("loss_type", TRAIN_LOSS_TYPES)
def test_two_step_training_changes_lora_keeps_base(tiny, tmp_path, name, loss_type):
    model, tok = tiny[name]
    tok.padding_side = "left"
    trainer = EfficientGRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward, format_soft_reward],
        args=_args(tmp_path, loss_type),
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 16, seed=0)),
        processing_class=tok,
        peft_config=_lora(),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and set(changed) == set(trainable)
    frozen_changed = [
        n for n, p in trainer.model.named_parameters() if not p.requires_grad and not torch.equal(p, before[n])
    ]
    assert frozen_changed == []
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


def test_two_step_training_with_coupled_tokens(tiny, tmp_path):
    """GSPO with the entropy quantile and the bias-corrected KL, two passes per batch (old log-probs
    differ from the policy's on the second): the coupled path of the loss inside real training steps."""
    model, tok = tiny["tiny-llama"]
    tok.padding_side = "left"
    args = _args(
        tmp_path,
        "grpo",
        importance_sampling_level="sequence",
        top_entropy_quantile=0.5,
        use_bias_correction_kl=True,
        num_iterations=2,
    )
    trainer = EfficientGRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=args,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 16, seed=0)),
        processing_class=tok,
        peft_config=_lora(),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all(h["kl"] >= 0 and "clip_ratio/region_mean" in h for h in logs)
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_trl_default_config_is_accepted_and_refusals_give_the_reason(tiny, tmp_path):
    model, tok = tiny["tiny-llama"]
    ds = to_prompt_dataset(generate_tasks("arithmetic", 4))
    trainer = EfficientGRPOTrainer(
        model=model, reward_funcs=[_reward], args=_args(tmp_path), train_dataset=ds, processing_class=tok
    )
    assert trainer.args.use_bias_correction_kl and trainer.loss_type == "dapo"  # TRL 1.16's defaults
    for kw, match in (
        (dict(entropy_coef=0.01), "entropy bonus .*not a multiple of d logp"),
        (dict(use_adaptive_entropy=True), "entropy bonus"),
    ):
        with pytest.raises(ValueError, match=match):
            EfficientGRPOTrainer(
                model=model, reward_funcs=[_reward], args=_args(tmp_path, **kw), train_dataset=ds, processing_class=tok
            )
    trainer.loss_type, trainer.use_vllm = "vespo", True  # what the kit's generation mixin sets after TRL's checks
    with pytest.raises(ValueError, match="vespo.*token_truncate"):
        trainer._check_vespo_importance_sampling()


# --- drift guard: what the subclass relies on in the pinned TRL ---------------------------


def test_trl_is_the_pinned_version():
    assert trl.__version__ == "1.16.0", (
        f"TRL {trl.__version__} is not the pinned 1.16.0: re-check EfficientGRPOTrainer's overrides "
        "(_get_per_token_logps_and_entropies, _compute_loss) against the new GRPOTrainer, then update the pin"
    )


# Every TRL / transformers Trainer method the kit overrides (trainer.py, generation/trainer_hook.py, guards.py,
# resume.py) or calls, with its parameters in TRL 1.16.
TRL_METHODS = {
    "_compute_loss": ["self", "model", "inputs"],
    "compute_loss": ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
    "_get_per_token_logps_and_entropies": [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    ],
    "_generate_single_turn": [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ],
    "_generate_and_score_completions": ["self", "inputs"],
    "get_high_entropy_mask": ["self", "entropies", "mask", "threshold"],
    "_prepare_inputs": ["self", "generation_batch"],
    "training_step": ["self", "model", "inputs", "num_items_in_batch"],
    "_clip_grad_norm": ["self", "model"],
    "_save_checkpoint": ["self", "model", "trial"],
    "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_load_scaler": ["self", "checkpoint"],
    "_load_rng_state": ["self", "checkpoint"],
    "store_flos": ["self"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "add_callback": ["self", "callback"],
}
# Attributes GRPOTrainer.__init__ sets that the kit reads or sets.
GRPO_ATTRIBUTES = (
    "loss_type",
    "beta",
    "epsilon_low",
    "epsilon_high",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "eos_token_ids",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "num_iterations",
    "top_entropy_quantile",
    "importance_sampling_level",
    "off_policy_mask_threshold",
    "entropy_coef",
    "use_adaptive_entropy",
    "_entropy_bonus_enabled",
    "aux_loss_enabled",
    "use_transformers_continuous_batching",
    "tools",
    "rollout_func",
    "environment_factories",
    "_is_vlm",
    "_step",
    "_buffered_inputs",
    "_metrics",
)
# transformers.Trainer attributes the kit reads.
TRAINER_ATTRIBUTES = (
    "accelerator",
    "state",
    "model_wrapped",
    "callback_handler",
    "optimizer",
    "lr_scheduler",
    "current_gradient_accumulation_steps",
)
# GRPOConfig fields the kit reads (the trainer passes grpo_kit.loss.objective.OBJECTIVE_OPTIONS to the loss under the same names).
GRPO_CONFIG_FIELDS = (
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "entropy_coef",
    "use_adaptive_entropy",
    "off_policy_mask_threshold",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "steps_per_generation",
    "gradient_checkpointing",
    "generation_kwargs",
)


@pytest.mark.parametrize("name", list(TRL_METHODS))
def test_trl_methods_the_kit_overrides_or_calls_keep_their_signatures(name):
    method = getattr(GRPOTrainer, name, None)
    assert callable(method), f"TRL {trl.__version__}: GRPOTrainer.{name} is gone; the kit overrides or calls it"
    params = list(inspect.signature(method).parameters)
    assert params == TRL_METHODS[name], (
        f"GRPOTrainer.{name} now takes {params}, the kit was written for {TRL_METHODS[name]}"
    )


def test_trl_attributes_and_config_fields_the_kit_reads_exist():
    import transformers

    from grpo_kit.loss.objective import LOSS_TYPES, ObjectiveSpec
    from grpo_kit.loss.objective import OBJECTIVE_OPTIONS as OBJECTIVE_FIELDS

    init_src = inspect.getsource(GRPOTrainer.__init__)
    missing = [a for a in GRPO_ATTRIBUTES if f"self.{a} =" not in init_src]
    assert not missing, f"GRPOTrainer.__init__ no longer sets {missing}"
    trainer_src = inspect.getsource(transformers.Trainer)
    missing = [a for a in TRAINER_ATTRIBUTES if f"self.{a} =" not in trainer_src]
    assert not missing, f"transformers.Trainer no longer sets {missing}"
    fields = GRPOConfig.__dataclass_fields__
    missing = [f for f in GRPO_CONFIG_FIELDS + OBJECTIVE_FIELDS if f not in fields]
    assert not missing, f"GRPOConfig no longer has {missing}"
    # the loss API's defaults of the shared options are TRL's (use_bias_correction_kl: the loss API keeps the
    # plain k3 by default; the trainer passes the config's value, TRL's default True included)
    spec = ObjectiveSpec()
    for f in OBJECTIVE_FIELDS:
        if f != "use_bias_correction_kl":
            assert getattr(spec, f) == fields[f].default, f
    # every loss type TRL documents is one the objective computes, and no more
    help_text = fields["loss_type"].metadata["help"]
    supported = help_text[help_text.index("Supported values are") :].split(".")[0]
    assert sorted(re.findall(r"'(\w+)'", supported)) == sorted(LOSS_TYPES), supported


def test_trl_loss_still_reads_what_we_feed_it():
    """Behavioural drift: TRL's loss must still take these inputs and normalise as we mirror."""
    src = inspect.getsource(GRPOTrainer._compute_loss)
    for needle in (
        'inputs["prompt_ids"]',
        'inputs["completion_ids"]',
        'inputs["advantages"]',
        'inputs.get("old_per_token_logps")',
        'inputs["ref_per_token_logps"]',
        'inputs["num_items_in_batch"]',
        "self.current_gradient_accumulation_steps",
        "self.args.steps_per_generation",
        "self.accelerator.num_processes",
        "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1",
        'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]',
        "if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type",
        'importance_sampling_ratio=inputs.get("importance_sampling_ratio")',
        "self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)",
        "if self.args.use_bias_correction_kl:",
        "coef_1 = torch.clamp(coef_1, max=self.args.delta)",
    ):
        assert needle in src, f"TRL's _compute_loss no longer contains {needle!r}"
    gen_src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "_get_per_token_logps_and_entropies" in gen_src  # ref/old passes still go through our override
    assert "disable_adapter" in inspect.getsource(trl.trainer.grpo_trainer) or "use_adapter" in gen_src


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_checkpointing_stays_off_under_the_kits_own_during_train(tmp_path, reentrant):
    """Trainer.train() (and TRL's generation) switch HF's per-layer checkpointing back on after the trainer
    was built. With ``use_reentrant=True`` HF's checkpoint would then recompute the kit's offloaded layer once
    more in backward (with the default non-reentrant one it finds nothing saved to recompute). Every training
    forward must see HF's flag off, and each layer runs one training forward per micro-batch."""
    model, tok = load_model("tiny-llama")  # fresh: the module's shared models carry earlier tests' adapters
    tok.padding_side = "left"
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, levels=(1,), seed=0))
    args = _args(
        tmp_path, gradient_checkpointing=True, max_steps=1, gradient_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    trainer = EfficientGRPOTrainer(
        model=model,
        args=args,
        processing_class=tok,
        reward_funcs=[_reward],
        train_dataset=ds,
        offload_checkpointing=True,
        peft_config=_lora(),
    )
    layers = [m for m in trainer.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    seen = []
    hooks = [
        m.register_forward_pre_hook(lambda m, a: seen.append((m.gradient_checkpointing, torch.is_grad_enabled())))
        for m in layers
    ]
    trainer.train()
    for h in hooks:
        h.remove()
    graded = [flag for flag, grad in seen if grad]
    assert not any(graded), f"HF checkpointing was on in {sum(graded)} of {len(graded)} training forwards"
    assert len(graded) == len(layers)  # one micro-batch of 4 completions: one training forward per layer
    assert trainer.args.gradient_checkpointing  # TRL's own flag is untouched; only the layers' is kept off


def test_make_trainer_resolves_an_auto_scoring_batch_size(tmp_path):
    """``scoring_batch_size: auto`` reaches the trainer as the calculator's number: the generation memory plan's
    where there is one (vLLM on CUDA prices its own generation phase), else the config's estimate on the model's
    own config."""
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory import scoring_batch_for_config
    from grpo_kit.trainer.grpo_trainer import make_trainer

    model, tok = load_model("tiny-llama")
    cfg = GRPOKitConfig(
        model="tiny-llama",
        device="cpu",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        num_generations=4,
    ).validate()
    kw = dict(
        model=model,
        tokenizer=tok,
        reward_funcs=[_reward],
        args=_args(tmp_path),
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
        peft_config=_lora(),
    )
    # the tiny model's scoring logits chunk (S x C rows of a 49,152-token vocabulary) outgrows its whole training step at
    # any S above the micro-batch, so the calculator keeps TRL's chunking (the rule's own tests: test_memory.py)
    assert scoring_batch_for_config(cfg, model.config) is None
    assert make_trainer(cfg, **kw).scoring_batch_size is None
    assert make_trainer(cfg, **kw, memory_plan={"scoring_batch_size": 3}).scoring_batch_size == 3
    cfg.scoring_batch_size = 5  # a number the user set wins over any plan
    assert make_trainer(cfg, **kw, memory_plan={"scoring_batch_size": 3}).scoring_batch_size == 5


def test_scoring_batch_size_sets_the_no_grad_forwards(tmp_path):
    """``scoring_batch_size`` chunks TRL's no-grad scoring passes (called with TRL's per-device batch size) into
    that many sequences per forward, the last chunk shorter; the log-probs are those of one sequence at a time.
    ``make_trainer`` takes it from the config."""
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.trainer.grpo_trainer import make_trainer

    model, tok = load_model("tiny-llama")  # fresh: the module's shared models carry earlier tests' adapters
    cfg = GRPOKitConfig(model="tiny-llama", scoring_batch_size=3, device="cpu")
    cfg.validate()
    trainer = make_trainer(
        cfg,
        model=model,
        tokenizer=tok,
        reward_funcs=[_reward],
        args=_args(tmp_path),
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
        peft_config=_lora(),
    )
    assert trainer.scoring_batch_size == 3
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (5, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in one row
    sizes, hidden = [], trainer._completion_hidden
    trainer._completion_hidden = lambda m, i, a, k, aux=False: sizes.append(i.size(0)) or hidden(m, i, a, k, aux)
    with torch.no_grad():
        batched = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 8, batch_size=1)[0]
        chunked_sizes, sizes[:] = list(sizes), []
        trainer.scoring_batch_size = None
        single = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 8, batch_size=1)[0]
    assert chunked_sizes == [3, 2] and sizes == [1] * 5
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)


def test_full_fine_tuning_scores_the_reference_with_its_own_layers(tmp_path):
    """Full fine-tuning with beta > 0: TRL keeps a separate reference model and scores it through the kit's hook;
    its final norm and head are the reference model's own (they were the policy's: no hidden state came back)."""
    from transformers import AutoModelForCausalLM

    model, tok = load_model("tiny-llama")
    model.save_pretrained(tmp_path / "m")  # TRL builds its reference copy from the model's folder
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    trainer = EfficientGRPOTrainer(
        model=model,
        reward_funcs=[_reward],
        args=_args(tmp_path, beta=0.04),
        processing_class=tok,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
    )
    ref = trainer.ref_model
    assert ref is not None and ref is not trainer.model
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(0.5)  # the reference now differs from the policy
    ids = torch.randint(3, 1000, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0], [1] * 10])
    with torch.no_grad():
        got = trainer._get_per_token_logps_and_entropies(ref, ids, mask, 4)[0]
        policy = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)[0]
        logits = ref(input_ids=ids, attention_mask=mask).logits[:, -5:-1].float() / trainer.temperature
        want = logits.log_softmax(-1).gather(-1, ids[:, -4:, None]).squeeze(-1)
    counted = mask[:, -4:].bool()
    torch.testing.assert_close(got[counted], want[counted], rtol=1e-5, atol=1e-5)
    assert (policy[counted] - want[counted]).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padded_batches_reach_the_model_without_a_mask(tmp_path, attention):
    """TRL's left-padded prompts and right-padded completions go in rolled (grpo_kit.model.causal_layout), so the model
    gets no attention mask and builds no (B, 1, T, T) one; a pad between real tokens keeps the mask."""
    model, tok = load_model("tiny-llama")  # fresh: the module's shared models carry earlier tests' adapters
    trainer = EfficientGRPOTrainer(
        model=model,
        reward_funcs=[_reward],
        args=_args(tmp_path),
        processing_class=tok,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
        peft_config=_lora(),
    )
    trainer.model.get_base_model().config._attn_implementation = attention
    seen = []
    hook = trainer.model.get_base_model().model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True
    )
    ids = torch.randint(3, 1000, (2, 10), generator=torch.Generator().manual_seed(1))
    padded = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [1] * 10])
    hole = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 0, 0], [1] * 10])
    with torch.no_grad():
        a = trainer._get_per_token_logps_and_entropies(trainer.model, ids, padded, 4)[0]
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, hole, 4)
    hook.remove()
    assert seen[0] is None and torch.equal(seen[1], hole)
    assert torch.isfinite(a[0, :2]).all() and a.shape == (2, 4)
