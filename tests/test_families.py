"""The supported families (grpo_kit/model/families.py), each proven on its tiny built-in in fp32:

* the reference log-probs, the loss and the LoRA gradients of the kit's trainer equal stock TRL 1.16's on one fixed
  batch, for ``grpo`` and ``dapo`` (MoE families: TRL's router load-balancing loss included, with TRL's own
  coefficient);
* gradients under offloaded checkpointing (its CPU mode: the same pool, copies and recompute) equal those of the
  plain forward, LoRA on every target the kit finds;
* the kit's view of the model (anatomy) and the refusals of what it cannot map.
"""

import copy

import pytest
import torch
from _parity import check_reference_and_fill
from peft import LoraConfig, get_peft_model
from trl import GRPOConfig, GRPOTrainer

from grpo_kit.model import anatomy
from grpo_kit.model.families import BUILTIN_MODELS, FAMILIES, tiny_names
from grpo_kit.model.loading import build_random_model, load_tokenizer
from grpo_kit.model.offload import enable_offloaded_checkpointing, layer_modes
from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
from grpo_kit.tasks.rewards import correctness_reward
from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

TINY = [name for fam in FAMILIES for name in tiny_names(fam)]
# tiny-llama and tiny-qwen2 are held to TRL in tests/test_trainer.py over every objective setting, and the first
# three families' offloaded gradients in tests/test_checkpointing.py (fp64 and fp32, with and without LoRA)
NEWER = [n for n in TINY if n not in ("tiny-llama", "tiny-qwen2", "tiny-mistral")]


def test_every_family_has_a_tiny_builtin_and_the_table_covers_the_issue():
    assert {
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-smollm3",
        "tiny-phi3",
        "tiny-olmo2",
        "tiny-olmo3",
        "tiny-granite",
        "tiny-qwen3-moe",
        "tiny-gpt-oss",
        "tiny-llama",
        "tiny-qwen2",
        "tiny-mistral",
    } <= set(TINY)
    assert all(BUILTIN_MODELS[n].kind == "tiny" for n in TINY)


def _args(tmp_path, loss_type):
    return GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        max_steps=1,
        temperature=0.7,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        beta=0.04,
        loss_type=loss_type,
        epsilon=0.2,
    )


def _batch(gen, vocab=1000):
    B, P, C = 4, 6, 8
    inputs = dict(
        prompt_ids=torch.randint(3, vocab, (B, P), generator=gen),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        completion_ids=torch.randint(3, vocab, (B, C), generator=gen),
        completion_mask=(torch.arange(C)[None] < torch.tensor([[8], [5], [3], [7]])).long(),
        advantages=torch.randn(B, generator=gen),
        num_items_in_batch=torch.tensor(23.0),
    )
    inputs["prompt_mask"][0, :2] = 0  # left padding
    return inputs


@pytest.mark.parametrize("name", [n for n in TINY if n not in ("tiny-llama", "tiny-qwen2")])
def test_logps_loss_and_lora_grads_equal_stock_trl(name, tmp_path):
    """One pair of trainers per family (their construction is most of the time), both loss types in turn."""
    model = build_random_model(name)
    tok = load_tokenizer(name)
    tok.padding_side = "left"
    targets = anatomy.lora_targets(model)
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0))
    stock, ours = (
        cls(
            model=copy.deepcopy(model),
            reward_funcs=[correctness_reward],
            args=_args(tmp_path, "grpo"),
            train_dataset=ds,
            processing_class=tok,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"),
        )
        for cls in (GRPOTrainer, EfficientGRPOTrainer)
    )
    gen = torch.Generator().manual_seed(1)
    for (_, p1), (_, p2) in zip(stock.model.named_parameters(), ours.model.named_parameters()):
        if p1.requires_grad:  # a non-zero adapter, so that it matters
            v = torch.randn(p1.shape, generator=gen) * 0.05
            p1.data.copy_(v), p2.data.copy_(v)
    inputs = _batch(gen)
    check_reference_and_fill(stock, ours, inputs, gen)
    assert ours.aux_loss_enabled == stock.aux_loss_enabled == (anatomy.router_aux_coef(model.config) > 0)
    for loss_type in ("grpo", "dapo"):
        for t in (stock, ours):
            t.loss_type = loss_type
            t.model.zero_grad(set_to_none=True)
        loss_stock = stock._compute_loss(stock.model, inputs)
        loss_ours = ours._compute_loss(ours.model, inputs)
        torch.testing.assert_close(loss_ours, loss_stock, rtol=1e-5, atol=1e-7, msg=loss_type)
        loss_stock.backward(), loss_ours.backward()
        checked = 0
        for (n, p1), (_, p2) in zip(stock.model.named_parameters(), ours.model.named_parameters()):
            if p1.requires_grad:  # relative to the tensor's largest gradient (elementwise: tiny entries are noise)
                err = float((p2.grad - p1.grad).abs().max() / p1.grad.abs().max().clamp_min(1e-30))
                assert err <= 1e-5, f"{loss_type} {n}: max difference {err:.2e} of the largest gradient"
                checked += 1
        assert checked == 2 * sum(
            isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets
            for layer in anatomy.decoder_layers(model)
            for n, m in layer.named_modules()
        )
        if stock.aux_loss_enabled:  # the router loss is in both, and the same
            assert ours._metrics["train"]["aux_loss"][-1] == pytest.approx(
                stock._metrics["train"]["aux_loss"][-1], rel=1e-5
            )


@pytest.mark.parametrize("name", NEWER)
def test_offloaded_checkpointing_gradients_equal_the_plain_forward(name):
    torch.manual_seed(0)
    base = build_random_model(name)
    targets = anatomy.lora_targets(base)

    def lora():
        torch.manual_seed(1)
        return get_peft_model(
            copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)
        )

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 1000, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0

    def grads(model):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
        out.loss.backward()
        return {k: p.grad for k, p in model.named_parameters() if p.requires_grad}

    want = grads(lora())
    ours = lora()
    # 16 tokens per slice: 5 slices of the 2 x 40 tokens, past the tiny sliding windows (8-16 tokens)
    enable_offloaded_checkpointing(ours, chunk_tokens=16, min_bytes=0, _offload_on_cpu=True)
    got = grads(ours)
    assert set(got) == set(want) and len(got) > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)
    modes = layer_modes(ours)
    assert sum(modes.values()) == base.config.num_hidden_layers
    assert set(modes) <= {"split", "whole+mlp"}  # every layer's MLP (dense or MoE) in slices, either way


def test_the_layout_decides_the_mode_not_the_class_name():
    modes = {}
    for name in ("tiny-llama", "tiny-qwen3", "tiny-olmo2", "tiny-smollm3", "tiny-qwen3-moe", "tiny-gpt-oss"):
        model = enable_offloaded_checkpointing(build_random_model(name), _offload_on_cpu=True)
        modes[name] = layer_modes(model)
    assert modes["tiny-llama"] == modes["tiny-qwen3"] == modes["tiny-qwen3-moe"] == {"split": 2}  # pre-norm
    assert modes["tiny-olmo2"] == {"whole+mlp": 2}  # post-norm
    assert modes["tiny-smollm3"] == {"split": 1, "whole+mlp": 1}  # its second layer has no rotary embedding
    assert modes["tiny-gpt-oss"] == {"whole+mlp": 2}  # its MoE block returns router scores beside the states


@pytest.mark.parametrize(
    "name, form",
    [
        ("tiny-granite", anatomy.LogitForm(scale=1 / 8)),
        ("tiny-gemma3", anatomy.LogitForm(softcap=30.0)),
        ("tiny-llama", anatomy.LogitForm()),
    ],
)
def test_logit_form_is_read_from_the_config_and_held_to_the_models_logits(name, form):
    model = build_random_model(name)
    assert anatomy.logit_form(model.config) == form
    anatomy.check_logit_form(model, form)
    if not form.plain:  # ignoring the form would not pass
        with pytest.raises(anatomy.AnatomyError, match="a logit transform the kit does not know"):
            anatomy.check_logit_form(model, anatomy.LogitForm())


class _OtherHead(torch.nn.Linear):
    """A head that forms its logits some other way than ``h @ W^T``."""

    def forward(self, x):
        return super().forward(x) * 1.7 + 0.3


def test_a_logit_transform_the_kit_does_not_know_is_refused(tmp_path):
    model = build_random_model("tiny-llama")
    head = _OtherHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    with pytest.raises(anatomy.AnatomyError, match="LlamaForCausalLM: its logits are not h @ W"):
        EfficientGRPOTrainer(
            model=model,
            reward_funcs=[correctness_reward],
            args=_args(tmp_path, "grpo"),
            train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
            processing_class=load_tokenizer("tiny-llama"),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        )


def test_lora_targets_are_the_models_own_projections_routers_excluded():
    assert anatomy.lora_targets(build_random_model("tiny-phi3")) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    moe = build_random_model("tiny-qwen3-moe")
    assert anatomy.lora_targets(moe) == ["k_proj", "o_proj", "q_proj", "v_proj"]  # experts are fused parameters
    assert anatomy.num_experts(moe.config) == 4 and anatomy.router_aux_coef(moe.config) == 0.001


def test_a_model_without_decoder_layers_is_refused_naming_what_is_missing():
    with pytest.raises(anatomy.AnatomyError, match="no decoder body"):
        anatomy.decoder_layers(torch.nn.Linear(2, 2))
