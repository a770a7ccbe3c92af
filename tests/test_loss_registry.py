"""The registry of loss types drives every place that depends on the loss type: a toy type registered here,
outside the package, trains with the kit's trainer; normalisers, their input checks, guards.split_weights and
the logged metrics follow each registered type's declaration."""

import copy

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig

from grpo_kit.loss.efficient import efficient_grpo_loss
from grpo_kit.loss.objective import LOSS_TYPES, ObjectiveSpec, check_normaliser_args, token_weights
from grpo_kit.loss.reference import grpo_loss_reference
from grpo_kit.loss.registry import LossMetrics, get_loss_type, register_loss, registered_loss_types
from grpo_kit.model.loading import load_model
from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
from grpo_kit.tasks.rewards import completion_text
from grpo_kit.trainer.grpo_trainer import LOGGED_METRICS, EfficientGRPOTrainer
from grpo_kit.trainer.guards import _split_batch, split_weights

TOY = "toy_reinforce"
TOY_METRICS = LossMetrics(
    ("toy/positive_advantage",),
    lambda parts, advantages, spec, mean, seq_mean: {"toy/positive_advantage": mean(advantages > 0)},
)

if TOY not in registered_loss_types():  # pytest may import this file once per session only; stay safe

    @register_loss(TOY, normaliser="token_mean", metrics=TOY_METRICS)
    def toy_reinforce(t, spec):
        """Plain REINFORCE, -A * logp: no ratio, no clip."""
        return -t.advantages * t.logp


def _case(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.tensor([[7], [3], [1], [5]])).long()
    logps, old, ref = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    return dict(
        completion_ids=torch.randint(0, 50, (B, T), generator=g),
        completion_mask=mask,
        advantages=torch.randn(B, generator=g, dtype=torch.float64),
        logps=logps,
        old=old,
        ref=ref,
    )


def test_builtin_types_are_trls_and_the_toy_joins_the_registry_only():
    assert LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
    assert TOY in registered_loss_types() and TOY not in LOSS_TYPES
    assert ObjectiveSpec(loss_type=TOY).token_local
    with pytest.raises(ValueError, match="loss_type must be one of"):
        ObjectiveSpec(loss_type="not_registered")


def test_registering_twice_or_with_an_unknown_normaliser_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_loss("grpo", normaliser="sequence_mean")(lambda t, spec: t.logp)
    with pytest.raises(ValueError, match="normaliser must be one of"):
        register_loss("toy_other", normaliser="per_prompt")
    assert "toy_other" not in registered_loss_types()


# what each normaliser's weights must be, written out: m the mask, B sequences, L_i active tokens of sequence i
EXPECTED_WEIGHTS = {
    "sequence_mean": lambda m, L, n: m / (m.shape[0] * m.sum(-1, keepdim=True).clamp(min=1)),
    "token_mean": lambda m, L, n: m / m.sum(),
    "max_length": lambda m, L, n: m / (m.shape[0] * L),
    "token_count": lambda m, L, n: m / n,
    "sequence_sum": lambda m, L, n: m / m.shape[0],
}


@pytest.mark.parametrize("name", registered_loss_types())
def test_normaliser_weights_and_input_checks_follow_the_registry(name):
    c = _case()
    normaliser = get_loss_type(name).normaliser
    m = c["completion_mask"].double()
    w = token_weights(c["completion_mask"], name, 9, 13, dtype=torch.float64)
    torch.testing.assert_close(w, EXPECTED_WEIGHTS[normaliser.name](m, 9, 13))
    check_normaliser_args(name, 9, 13)
    for missing, args in (("max_completion_length", (None, 13)), ("num_items_in_batch", (9, None))):
        if missing in normaliser.needs:
            with pytest.raises(ValueError, match=f"needs {missing}"):
                check_normaliser_args(name, *args)
        else:
            check_normaliser_args(name, *args)
    assert normaliser.global_count == (normaliser.name == "token_count")


@pytest.mark.parametrize("name", registered_loss_types())
def test_split_weights_follow_the_registry(name):
    """guards.split_weights gives each half the share its normaliser implies: the halves' weighted losses sum
    to the whole micro-batch's loss for every registered type, the toy included."""
    full = _case(1)
    kw = dict(
        beta=0.04,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=name,
        max_completion_length=7,
        num_items_in_batch=float(full["completion_mask"].sum()),
    )

    def loss(b):
        return grpo_loss_reference(b["logps"], b["old"], b["ref"], b["advantages"], b["completion_mask"], **kw)[0]

    halves = _split_batch(full, 2)
    weights = split_weights(halves, full, name)
    torch.testing.assert_close(sum(w * loss(h) for w, h in zip(weights, halves)), loss(full))


@pytest.mark.parametrize("name", registered_loss_types())
def test_the_trainer_logs_every_metric_the_loss_returns(name):
    c = _case(2)
    _, metrics = grpo_loss_reference(
        c["logps"],
        c["old"],
        c["ref"],
        c["advantages"],
        c["completion_mask"],
        beta=0.04,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=name,
        max_completion_length=7,
        num_items_in_batch=20.0,
    )
    own = get_loss_type(name).metrics
    logged = set(LOGGED_METRICS) | set(own.names if own is not None else ())
    assert set(metrics) - {"ratio_mean"} <= logged, set(metrics) - logged


@pytest.mark.parametrize("trainable_head", [False, True])
def test_the_toy_efficient_loss_matches_its_reference(trainable_head):
    """The chunked loss evaluates a registered type through the same registry (a token-local one with a trainable
    head takes its coefficients inside the chunk loop)."""
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 3, 5, 16, 41
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3).requires_grad_(trainable_head)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    loss, metrics = efficient_grpo_loss(hidden, weight, ids, mask, adv, loss_type=TOY, chunk_size=4)
    loss.backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(trainable_head)
    logps = torch.log_softmax(h2 @ w2.t(), -1).gather(-1, ids[..., None])[..., 0]
    ref_loss, ref_metrics = grpo_loss_reference(
        logps, None, None, adv, mask, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type=TOY
    )
    ref_loss.backward()
    tol = dict(rtol=1e-5, atol=1e-6)  # the chunked loss takes fp32 log-probs
    torch.testing.assert_close(loss.double(), ref_loss, **tol)
    torch.testing.assert_close(hidden.grad, h2.grad, **tol)
    if trainable_head:
        torch.testing.assert_close(weight.grad, w2.grad, **tol)
    assert (
        float(metrics["toy/positive_advantage"])
        == float(ref_metrics["toy/positive_advantage"])
        == float((adv > 0).double().mean())
    )


def _reward(prompts, completions, **kw):  # dense and varied, so advantages are non-zero from step 1
    return [float(sum(map(ord, completion_text(c))) % 7) / 7 for c in completions]


def test_a_loss_type_registered_outside_the_package_trains(tmp_path):
    """TRL's GRPOConfig does not check loss_type and only TRL's own _compute_loss reads it, which the kit's
    trainer replaces: the toy type trains two steps on tiny-llama and logs its own metric."""
    model, tok = load_model("tiny-llama")
    tok.padding_side = "left"
    args = GRPOConfig(
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
        loss_type=TOY,
        beta=0.04,
        use_bias_correction_kl=False,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = EfficientGRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=args,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
        processing_class=tok,
        peft_config=lora,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert before and set(changed) == set(before)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all("toy/positive_advantage" in h and "kl" in h for h in logs), logs


def test_the_config_takes_a_registered_loss_type_and_names_it_when_refusing():
    from grpo_kit.app.config import ConfigError, GRPOKitConfig

    assert GRPOKitConfig(loss_type=TOY).validate().loss_type == TOY
    with pytest.raises(ConfigError, match=f"loss_type='nope' is not allowed; choose one of .*'{TOY}'"):
        GRPOKitConfig(loss_type="nope").validate()
