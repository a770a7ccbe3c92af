"""Prefix-shared scoring (grpo_kit/model/prefix.py) equals the unshared computation.

Tiny built-ins of three families (Llama; Qwen3 with QK-norm; Gemma 3 with sliding-window layers and a logit
soft-cap), fp32, the kit's trainer with a non-zero LoRA adapter on every projection: the reference (adapter off) and
old-policy log-probs, and the loss and LoRA gradients of ``grpo``, ``dapo`` and GSPO (sequence-level importance
ratio), with prefix sharing equal those without it (1e-5, gradients relative to each tensor's largest), on the plain
forward and under the kit's offloaded checkpointing (its CPU mode). One batch holds groups of different prompt
lengths (so different left padding), completions of unequal length, rows in shuffled order, and a group whose
prompts differ, which falls back and is said once.
"""

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from trl import GRPOConfig

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.model import anatomy
from grpo_kit.model.loading import build_random_model, load_tokenizer
from grpo_kit.model.offload import enable_offloaded_checkpointing
from grpo_kit.model.prefix import (
    AUTO_MIN_PROMPT_TOKENS,
    PrefixCache,
    check_prefix_sharing,
    plan_prefix_groups,
    shared_group_hidden,
)
from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
from grpo_kit.tasks.rewards import correctness_reward
from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

W, C = 20, 8  # prompt columns (left-padded), completion columns (right-padded)
# (prompt length, completion lengths) of each row; rows of one group share one prompt
GROUPS = ((18, (8, 5, 3, 7)), (11, (6, 8, 2)))
ODD = ((20, 4), (15, 8))  # a "group" whose two prompts differ
LOSSES = (("grpo", "token"), ("dapo", "token"), ("grpo", "sequence"))  # the last: GSPO


def _batch(gen, vocab=1000):
    rows = []  # (prompt tokens, completion length)
    for n, lengths in GROUPS:
        prompt = torch.randint(3, vocab, (n,), generator=gen)
        rows += [(prompt, c) for c in lengths]
    rows += [(torch.randint(3, vocab, (n,), generator=gen), c) for n, c in ODD]
    order = torch.randperm(len(rows), generator=gen).tolist()  # groups interleaved, as TRL's shuffle leaves them
    B = len(rows)
    prompt_ids = torch.full((B, W), 2, dtype=torch.long)
    prompt_mask = torch.zeros(B, W, dtype=torch.long)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for i, j in enumerate(order):
        prompt, c = rows[j]
        prompt_ids[i, W - prompt.numel() :], prompt_mask[i, W - prompt.numel() :] = prompt, 1
        completion_mask[i, :c] = 1
    completion_ids = torch.randint(3, vocab, (B, C), generator=gen).masked_fill(completion_mask == 0, 2)
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=torch.randn(B, generator=gen),
        num_items_in_batch=completion_mask.sum().float(),
    )


def _trainer(name, tmp_path):
    model = build_random_model(name)
    tok = load_tokenizer(name)
    tok.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=C,
        report_to="none",
        use_cpu=True,
        max_steps=1,
        temperature=0.7,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        beta=0.04,
        epsilon=0.2,
        gradient_checkpointing=False,
    )
    trainer = EfficientGRPOTrainer(
        model=model,
        reward_funcs=[correctness_reward],
        args=args,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
        processing_class=tok,
        offload_checkpointing=False,
        prefix_sharing=False,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=anatomy.lora_targets(model), task_type="CAUSAL_LM"),
    )
    gen = torch.Generator().manual_seed(1)
    for p in trainer.model.parameters():
        if p.requires_grad:  # a non-zero adapter, so that it matters
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    trainer.current_gradient_accumulation_steps = 2  # what Trainer.train() sets; two micro-batches a generation
    trainer.args.steps_per_generation = 2
    return trainer


def _scores(trainer, inputs, sharing):
    """(reference log-probs, old-policy log-probs), (B, C) fp32, with ``sharing``."""
    trainer.prefix_sharing = sharing
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        with trainer.model.disable_adapter():
            ref = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, C, batch_size=16)[0]
        old = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, C, batch_size=16)[0]
    return ref, old


def _loss_and_grads(trainer, inputs, sharing, loss_type, level):
    trainer.prefix_sharing, trainer.loss_type = sharing, loss_type
    trainer.args.importance_sampling_level = level
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _assert_same(got, want, what):
    loss_got, grads_got = got
    loss_want, grads_want = want
    torch.testing.assert_close(loss_got, loss_want, rtol=1e-5, atol=1e-7, msg=what)
    assert set(grads_got) == set(grads_want) and grads_want
    for n, g in grads_want.items():
        err = float((grads_got[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        assert err <= 1e-5, f"{what} {n}: max difference {err:.2e} of the largest gradient"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_shared_prompts_score_as_the_unshared_computation(name, tmp_path):
    trainer = _trainer(name, tmp_path)
    gen = torch.Generator().manual_seed(2)
    inputs = _batch(gen)
    cm = inputs["completion_mask"].bool()
    ref, old = _scores(trainer, inputs, False)
    with pytest.warns(UserWarning, match="2 of 9 rows have a prompt no other row"):
        ref_shared, old_shared = _scores(trainer, inputs, True)
    stats = dict(trainer.prefix_sharing_stats)
    assert stats["groups"] == 4 and stats["shared_rows"] == 14 and stats["alone_rows"] == 4  # two passes
    assert stats["prompt_tokens_saved"] == 2 * (3 * 18 + 2 * 11)
    torch.testing.assert_close(ref_shared[cm], ref[cm], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old_shared[cm], old[cm], rtol=1e-5, atol=1e-5)
    inputs["ref_per_token_logps"] = ref
    inputs["old_per_token_logps"] = ref + 0.1 * torch.randn(ref.shape, generator=gen)  # clipping exercised
    want = {(lt, lvl): _loss_and_grads(trainer, inputs, False, lt, lvl) for lt, lvl in LOSSES}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once already: not again
        for lt, lvl in LOSSES:
            _assert_same(_loss_and_grads(trainer, inputs, True, lt, lvl), want[lt, lvl], f"plain {lt}/{lvl}")
    enable_offloaded_checkpointing(trainer.model, chunk_tokens=16, min_bytes=0, pin_memory=False, _offload_on_cpu=True)
    trainer._offloaded_checkpointing = True
    for lt, lvl in LOSSES:
        _assert_same(_loss_and_grads(trainer, inputs, True, lt, lvl), want[lt, lvl], f"offloaded {lt}/{lvl}")
    # the no-grad passes under offloaded checkpointing share too
    ref_off, old_off = _scores(trainer, inputs, True)
    torch.testing.assert_close(ref_off[cm], ref[cm], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old_off[cm], old[cm], rtol=1e-5, atol=1e-5)


def test_the_plan_groups_by_content_and_auto_shares_only_what_pays():
    P = AUTO_MIN_PROMPT_TOKENS + 8
    prompt = torch.arange(3, 3 + P)
    ids = torch.stack([prompt, prompt, prompt.flip(0), prompt, prompt.flip(0), prompt + 1])
    mask = torch.ones_like(ids)
    ids[5, :4], mask[5, :4] = 2, 0  # left padding: its real tokens differ from every other row's
    short = torch.ones(6, 16)
    plan = plan_prefix_groups(ids, mask, short, mode="auto")
    assert [g.rows for g in plan.groups] == [(0, 1, 3), (2, 4)] and plan.unshared == (5,) and plan.alone == 1
    assert plan.tokens_saved == 2 * P + P
    long = torch.ones(6, P + 1)  # completions longer than the prompt: auto leaves them alone, true shares
    assert not plan_prefix_groups(ids, mask, long, mode="auto").groups
    unpaid = plan_prefix_groups(ids, mask, long, mode="auto")
    assert unpaid.short == 6 and unpaid.alone == 0  # a lone row that would not have shared is not said to fall back
    assert len(plan_prefix_groups(ids, mask, long, mode=True).groups) == 2
    assert not plan_prefix_groups(ids, mask, short, mode=False).groups
    small = plan_prefix_groups(ids[:, -16:], mask[:, -16:], short[:, :4], mode="auto")
    assert not small.groups  # under AUTO_MIN_PROMPT_TOKENS
    holed = mask.clone()
    holed[0, 7] = 0  # not TRL's left-padded layout: scored as usual
    assert 0 in plan_prefix_groups(ids, holed, short, mode=True).unshared


def test_the_setting_takes_auto_true_false_only():
    assert [check_prefix_sharing(v) for v in ("auto", True, False, "true", "False")] == [
        "auto",
        True,
        False,
        True,
        False,
    ]
    for bad in ("yes", 1, None, "on"):
        with pytest.raises(ValueError, match="prefix_sharing must be auto, true or false"):
            check_prefix_sharing(bad)


def test_the_cache_records_once_and_attends_without_storing():
    cache = PrefixCache()
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    assert cache.get_seq_length() == 0 and cache.get_mask_sizes(5, 0) == (5, 0)
    cache.update(k, v, 0)
    cache.update(k, v, 0)  # a recompute records again: replaced, not appended
    cache.attend()
    new = torch.randn(3, 2, 2, 4)
    keys, values = cache.update(new, new, 0)
    assert keys.shape == (3, 2, 7, 4) and torch.equal(keys[2, :, :5], k[0]) and torch.equal(values[1, :, 5:], new[1])
    assert cache.get_seq_length() == 5 and cache.get_mask_sizes(2, 1) == (7, 0)
    assert cache.update(new, new, 0)[0].shape == (3, 2, 7, 4)  # reading again stores nothing


def test_hf_checkpointing_in_training_turns_the_policy_pass_unshared(tmp_path):
    """HF's per-layer checkpointing drops a cache in training: the policy pass then runs unshared, said once."""
    trainer = _trainer("tiny-llama", tmp_path)
    inputs = _batch(torch.Generator().manual_seed(3))
    inputs["old_per_token_logps"] = inputs["ref_per_token_logps"] = torch.zeros(inputs["completion_ids"].shape)
    want = _loss_and_grads(trainer, copy.copy(inputs), False, "grpo", "token")
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.train()
    with pytest.warns(UserWarning, match="HF's gradient checkpointing drops the KV cache"):
        got = _loss_and_grads(trainer, inputs, True, "grpo", "token")
    _assert_same(got, want, "hf checkpointing")


def test_with_lora_dropout_the_offloaded_pass_equals_the_plain_one():
    """LoRA dropout: an offloaded layer then runs as written, its recompute under the forward's RNG state; the
    shared pass under offloaded checkpointing equals the plain shared pass drawing the same masks."""
    base = build_random_model("tiny-qwen3")
    prompt, completions = torch.arange(3, 23), torch.randint(3, 900, (3, 7), generator=torch.Generator().manual_seed(4))

    def run(offload):
        torch.manual_seed(5)
        model = get_peft_model(
            copy.deepcopy(base),
            LoraConfig(
                r=4, lora_alpha=8, lora_dropout=0.2, init_lora_weights=False, target_modules=anatomy.lora_targets(base)
            ),
        )
        if offload:
            enable_offloaded_checkpointing(model, chunk_tokens=16, min_bytes=0, pin_memory=False, _offload_on_cpu=True)
        model.train()
        torch.manual_seed(6)
        hidden = shared_group_hidden(model, prompt, completions)
        (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
        return hidden.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (h_plain, g_plain), (h_off, g_off) = run(False), run(True)
    torch.testing.assert_close(h_off, h_plain, rtol=1e-5, atol=1e-6)
    _assert_same((torch.zeros(()), g_off), (torch.zeros(()), g_plain), "dropout")


def _unshared_hidden(model, prompt, completions):
    """The usual way: every row runs the prompt; rows P - 1 .. of the body's output, (G, C, H)."""
    box = []
    handle = anatomy.decoder_body(model).register_forward_hook(lambda _m, _i, out: box.append(out))
    try:
        model(
            input_ids=torch.cat([prompt.expand(len(completions), -1), completions], 1),
            use_cache=False,
            logits_to_keep=1,
        )
    finally:
        handle.remove()
    return anatomy.last_hidden(box[-1])[:, prompt.numel() - 1 : -1]


@pytest.mark.parametrize("weights", ["full fine-tuning", "fp8 base weights"])
def test_it_composes_with_full_fine_tuning_and_fp8_base_weights(weights):
    """Every weight trains (embeddings included), or LoRA over FP8 base weights (W8A8: each token row quantised on
    its own, so a prompt row rounds the same once as G times): the shared pass under offloaded checkpointing equals
    the plain unshared one."""
    from grpo_kit.model.fp8 import fp8_lora_config, quantize_model_fp8  # this test alone needs the FP8 layers

    base = build_random_model("tiny-llama")
    targets = anatomy.lora_targets(base)  # read before FP8 replaces the nn.Linear layers
    if weights == "fp8 base weights":
        quantize_model_fp8(base)
    prompt, completions = torch.arange(3, 30), torch.randint(3, 900, (3, 6), generator=torch.Generator().manual_seed(7))
    weight = torch.randn(3, 6, base.config.hidden_size, generator=torch.Generator().manual_seed(8))

    def grads(shared):
        model = copy.deepcopy(base)
        if weights == "fp8 base weights":
            torch.manual_seed(9)
            model = get_peft_model(
                model, fp8_lora_config(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets))
            )
        if shared:
            enable_offloaded_checkpointing(model, chunk_tokens=16, min_bytes=0, pin_memory=False, _offload_on_cpu=True)
        model.train()
        hidden = (shared_group_hidden if shared else _unshared_hidden)(model, prompt, completions)
        (hidden * weight).sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}

    want, got = grads(False), grads(True)
    assert len(want) == (20 if weights == "full fine-tuning" else 2 * 2 * 7)  # every weight but the unused head
    _assert_same((torch.zeros(()), got), (torch.zeros(()), want), weights)


@pytest.mark.parametrize("setting", [True, False])
def test_the_runs_setting_reaches_its_trainer(setting, tmp_path):
    """``prefix_sharing`` in the run's config is the trainer's: a run with ``true`` scores its groups shared (the
    summary counts them; the main job's prompts are short, so ``auto`` would share none), one with ``false``
    never plans a pass. (It once stopped at the config: ``grpo_kit train`` never shared.)"""
    from grpo_kit.app.run import train

    summary = train(
        GRPOKitConfig(
            model="tiny-llama",
            output_dir=str(tmp_path / "run"),
            generation_backend="hf",
            prefix_sharing=setting,
            max_steps=1,
            num_train_samples=4,
            num_eval_samples=0,
            max_completion_length=6,
            num_generations=4,
            per_device_train_batch_size=4,
            save_steps=0,
        )
    )
    stats = summary["prefix_sharing"]
    assert stats["setting"] is setting
    if setting:
        assert stats["passes"] > 0 and stats["shared_rows"] >= 4 and stats["prompt_tokens_saved"] > 0
    else:
        assert stats["passes"] == 0 and stats["shared_rows"] == 0
