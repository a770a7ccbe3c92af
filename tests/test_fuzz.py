"""Hypothesis fuzzing: answer extraction, reward functions and the GRPO loss on hostile inputs.

Properties: no exception other than a clear ``ValueError``; rewards are finite and in range; the
loss and its gradients are finite whenever the inputs are finite (extreme but finite log-probs,
large advantages, all-zero mask rows, odd shapes, any temperature), and the efficient loss equals
the reference where both are computed. Example counts come from the hypothesis profile
``grpo_kit_ci`` (``HYPOTHESIS_PROFILE=grpo_kit_deep`` for a longer local run); the Triton-interpreter
path gets a handful of examples in a subprocess because the interpreter is slow.
"""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_kit.loss.efficient import efficient_grpo_loss, per_token_logps
from grpo_kit.loss.objective import LOSS_TYPES
from grpo_kit.loss.reference import grpo_loss_reference
from grpo_kit.loss.registry import get_loss_type
from grpo_kit.tasks import rewards

ROOT = Path(__file__).resolve().parent.parent

settings.register_profile(
    "grpo_kit_ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "grpo_kit_deep",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "grpo_kit_ci"))

# --------------------------------------------------------------------------------------------
# text: answer extraction and reward functions
# --------------------------------------------------------------------------------------------
HUGE = [
    "10" + "0" * 5000,
    "1e999",
    "-1e-999",
    "9" * 400,
    "1" * 4400 + "/3",
    "1/0",
    "0/0",
    "$1,000,000,000,000,000",
    "1,234,567,890" * 50,
    "inf",
    "NaN",
    "-−7",
    "１２３",
    "٣",
    "⁵",
    "½",
    "1" + ".5" * 1000,
    "#### ",
    "Answer: ",
    "\\boxed{",
    "####" * 100,
    "answer is" * 1000,
]

texts = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.sampled_from(list("0123456789.,/-−$#: \nAnswer:boxed{}e")), max_size=400),
    st.lists(st.sampled_from(HUGE) | st.text(max_size=20), max_size=8).map(" ".join),
    st.builds(lambda s, k: (s or "9") * k, st.text(max_size=5), st.integers(1, 100_000 // 5)),  # up to 100K chars
    st.just(""),
    st.just("1" * 100_000),
    st.just("Answer: " + "9" * 100_000),
)
messages = st.one_of(
    texts,
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["assistant", "user", "tool"]), "content": st.one_of(texts, st.none())}
            ),
            st.none(),
            st.just([]),
            st.lists(st.none(), max_size=2),
            st.integers(),
            texts,
        ),
        max_size=4,
    ),
    st.fixed_dictionaries({"content": st.one_of(texts, st.none())}),
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": st.lists(
                    st.one_of(
                        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                        st.fixed_dictionaries({"type": st.just("image")}),
                    ),
                    max_size=3,
                ),
            }
        ),
        min_size=1,
        max_size=2,
    ),
    st.none(),
    st.integers(),
    st.floats(),
    st.just([[{"role": "assistant", "content": "Answer: 3"}]]),
)
answers = st.one_of(
    texts,
    st.integers(min_value=-(10**6000), max_value=10**6000),
    st.floats(),
    st.none(),
    st.just(10**5000),
    st.just(float("inf")),
)


def _clear_value_error(e: Exception) -> bool:
    return isinstance(e, ValueError) and len(str(e)) > 10


@given(texts)
def test_extract_number_never_crashes(text):
    value = rewards.extract_number(text)
    assert value is None or (isinstance(value, float) and math.isfinite(value))


@given(messages)
def test_completion_text_is_a_string_or_a_clear_value_error(completion):
    try:
        out = rewards.completion_text(completion)
    except Exception as e:  # noqa: BLE001 - the property is about which exceptions escape
        assert _clear_value_error(e), repr(e)
    else:
        assert isinstance(out, str)


@given(st.lists(st.tuples(messages, answers), min_size=1, max_size=4))
def test_reward_functions_score_in_range_or_raise_value_error(batch):
    completions = [c for c, _ in batch]
    answer = [a for _, a in batch]
    for fn, kw in (
        (rewards.correctness_reward, {"answer": answer}),
        (rewards.format_strict_reward, {}),
        (rewards.format_soft_reward, {}),
    ):
        try:
            scores = fn(None, completions, **kw)
        except Exception as e:  # noqa: BLE001
            assert _clear_value_error(e), f"{fn.__name__}: {e!r}"
            continue
        assert len(scores) == len(completions)
        assert all(isinstance(s, float) and s in (0.0, 1.0) for s in scores), (fn.__name__, scores)


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True))
def test_numbers_equal_never_matches_non_finite(a, b):
    if not (math.isfinite(a) and math.isfinite(b)):
        assert not rewards.numbers_equal(a, b)


# Pieces that made the old regexes backtrack (runs of spaces, fences, separators, marks), repeated to long texts.
_PIECES = [
    " ",
    "\t",
    "\n",
    "1",
    "9",
    ",",
    ".",
    "/",
    "e",
    "-",
    "$",
    "#### ",
    "```",
    "```python\n",
    "\\frac{",
    "}{",
    "}",
    "answer:",
    "Answer: ",
    "answer is ",
    "_",
    "\u2212",
    "\u202f",
    "x",
    "\\boxed{",
]
long_adversarial = st.lists(st.tuples(st.sampled_from(_PIECES), st.integers(1, 3000)), min_size=1, max_size=12).map(
    lambda parts: "".join(p * k for p, k in parts)[:60_000]
)


@settings(max_examples=25)
@given(long_adversarial)
def test_extractors_stay_fast_on_long_adversarial_text(text):
    import time

    from grpo_kit.tasks.code_reward import extract_code

    for call in (
        lambda: rewards.extract_number(text),
        lambda: rewards.format_strict_reward(None, [text]),
        lambda: rewards.format_soft_reward(None, [text]),
        lambda: extract_code(text),
        lambda: rewards.correctness_reward(None, [text], ["1"]),
    ):
        t = time.perf_counter()
        call()
        assert time.perf_counter() - t < 1.0, (call, len(text))


def test_regressions_found_by_fuzzing():
    # an infinite reference answer used to equal every number (abs(x - inf) <= 1e-6 * inf)
    assert rewards.correctness_reward(None, ["Answer: 5"], answer=[float("inf")]) == [0.0]
    # an integer answer too large for a float used to raise OverflowError
    assert rewards.correctness_reward(None, ["Answer: 5"], answer=[10**5000]) == [0.0]
    # content given as a list of parts (OpenAI style) used to raise TypeError in str.join
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "Answer: "}, {"type": "text", "text": "4"}]}]
    assert rewards.correctness_reward(None, [parts], answer=["4"]) == [1.0]
    with pytest.raises(ValueError, match="completion must be"):
        rewards.completion_text(None)


# --------------------------------------------------------------------------------------------
# the loss
# --------------------------------------------------------------------------------------------
EXTREME = [-1e4, -1e3, -100.0, -30.0, -1e-6, 0.0]


@st.composite
def loss_inputs(draw, max_b=4, max_t=6):
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["bool", "int", "float"]))
    mask = torch.rand(B, T, generator=g) < draw(st.floats(0.0, 1.0))
    if draw(st.booleans()):
        mask[draw(st.integers(0, B - 1))] = False  # an all-zero row
    mask = {"bool": mask, "int": mask.long(), "float": mask.float()}[kind]

    def logp_like(scale_choice):
        x = -torch.rand(B, T, generator=g, dtype=torch.float64) * draw(st.sampled_from([1.0, 10.0, 50.0]))
        if scale_choice:  # sprinkle extreme values
            pick = torch.rand(B, T, generator=g) < 0.3
            ext = torch.tensor(EXTREME, dtype=torch.float64)[torch.randint(len(EXTREME), (B, T), generator=g)]
            x = torch.where(pick, ext, x)
        return x.float()

    logps = logp_like(draw(st.booleans()))
    old = None if draw(st.booleans()) else logp_like(draw(st.booleans()))
    ref = logp_like(draw(st.booleans()))
    adv_scale = draw(st.sampled_from([1.0, 1e3, 1e4]))
    adv_shape = draw(st.sampled_from([(B,), (B, 1), (B, T)]))
    adv = torch.randn(adv_shape, generator=g) * adv_scale
    if draw(st.booleans()):
        adv = torch.zeros(adv_shape)
    opts = dict(
        beta=draw(st.sampled_from([0.0, 0.04, 1.0])),
        epsilon_low=draw(st.sampled_from([0.0, 0.2, 0.9])),
        epsilon_high=draw(st.sampled_from([None, 0.0, 0.28, 5.0])),
        loss_type=draw(st.sampled_from(LOSS_TYPES)),
    )
    opts["max_completion_length"] = T + draw(st.integers(0, 3))
    opts["num_items_in_batch"] = (
        draw(st.sampled_from([0, 1, B * T, 10**6]))
        if "num_items_in_batch" in get_loss_type(opts["loss_type"]).normaliser.needs
        else None
    )
    # (use_bias_correction_kl is left out: k3 times the ratio, each up to e^MAX_LOG_GAP, overflows fp32 by design)
    opts.update(
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])), delta=draw(st.sampled_from([None, 1.5]))
    )
    return logps, old, ref, adv, mask, opts


def _all_finite(*xs):
    return all(x is None or bool(torch.isfinite(x).all()) for x in xs)


@given(loss_inputs())
def test_reference_loss_finite_from_finite_inputs(inp):
    logps, old, ref, adv, mask, opts = inp
    logps = logps.clone().requires_grad_(True)
    loss, metrics = grpo_loss_reference(logps, old, ref, adv, mask, **opts)
    loss.backward()
    # log-prob gaps are clamped at MAX_LOG_GAP nats, so extreme but finite inputs never overflow exp()
    assert _all_finite(loss, logps.grad), (loss, logps.grad)
    for k in ("ratio_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        if k in metrics:
            assert _all_finite(metrics[k]), (k, metrics[k])


@st.composite
def head_inputs(draw):
    logps, old, ref, adv, mask, opts = draw(loss_inputs(max_b=3, max_t=5))
    B, T = logps.shape
    H, V = draw(st.integers(1, 8)), draw(st.integers(2, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.1, 1.0, 30.0]))
    hidden = torch.randn(B, T, H, generator=g) * scale
    weight = torch.randn(V, H, generator=g)
    ids = torch.randint(V, (B, T), generator=g)
    temperature = draw(st.sampled_from([0.05, 0.7, 1.0, 3.0]))
    chunk = draw(st.sampled_from([None, 1, 3, 64]))
    return hidden, weight, ids, old, ref, adv, mask, opts, temperature, chunk


@given(head_inputs())
def test_efficient_loss_finite_and_equal_to_the_reference(inp):
    hidden, weight, ids, old, ref, adv, mask, opts, temperature, chunk = inp
    h1 = hidden.clone().requires_grad_(True)
    loss, metrics = efficient_grpo_loss(
        h1,
        weight,
        ids,
        mask,
        adv,
        old_logps=old,
        ref_logps=ref,
        temperature=temperature,
        chunk_size=chunk,
        compute_entropy=True,
        epilogue="torch",
        **opts,
    )
    loss.backward()
    assert _all_finite(loss, h1.grad, metrics["entropy"], metrics["ratio_mean"]), (loss, h1.grad)
    # the same loss through full logits and the reference (fp64)
    h2 = hidden.double().requires_grad_(True)
    logps = torch.log_softmax((h2 @ weight.double().t()) / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ref_loss, _ = grpo_loss_reference(
        logps, None if old is None else old.double(), None if ref is None else ref.double(), adv.double(), mask, **opts
    )
    ref_loss.backward()
    tol = 1e-3 * max(1.0, abs(float(ref_loss)))
    assert abs(float(loss) - float(ref_loss)) <= tol, (float(loss), float(ref_loss))
    gscale = max(1.0, float(h2.grad.abs().max()))
    assert torch.allclose(h1.grad.double(), h2.grad, atol=2e-3 * gscale, rtol=2e-3), (h1.grad, h2.grad)


@given(head_inputs())
def test_per_token_logps_finite(inp):
    hidden, weight, ids, *_, temperature, chunk = inp
    out = per_token_logps(hidden, weight, ids, temperature=temperature, chunk_size=chunk, epilogue="torch")
    assert _all_finite(out) and bool((out <= 1e-5).all())


BAD = st.sampled_from(
    [
        "mask_shape",
        "adv_shape",
        "adv_nan",
        "old_shape",
        "old_int",
        "ref_missing",
        "logps_1d",
        "logps_int",
        "mask_nan",
        "loss_type",
        "eps_nan",
        "beta_neg",
        "dapo_none",
        "drgrpo_none",
        "ref_inf",
    ]
)


@given(loss_inputs(), BAD)
def test_bad_loss_inputs_raise_a_clear_value_error(inp, bad):
    logps, old, ref, adv, mask, opts = inp
    B, T = logps.shape
    opts = dict(opts)
    if bad == "mask_shape":
        mask = torch.ones(B, T + 1)
    elif bad == "adv_shape":
        adv = torch.ones(B + 1)
    elif bad == "adv_nan":
        adv = torch.full((B,), float("nan"))
    elif bad == "old_shape":
        old = torch.zeros(B, T + 2)
    elif bad == "old_int":
        old = torch.zeros(B, T, dtype=torch.long)
    elif bad == "ref_missing":
        ref, opts["beta"] = None, 0.1
    elif bad == "logps_1d":
        logps = logps.reshape(-1)
    elif bad == "logps_int":
        logps = logps.long()
    elif bad == "mask_nan":
        mask = torch.full((B, T), float("nan"))
    elif bad == "loss_type":
        opts["loss_type"] = "ppo"
    elif bad == "eps_nan":
        opts["epsilon_low"] = float("nan")
    elif bad == "beta_neg":
        opts["beta"] = -1.0
    elif bad == "dapo_none":
        opts["loss_type"], opts["num_items_in_batch"] = "dapo", None
    elif bad == "drgrpo_none":
        opts["loss_type"], opts["max_completion_length"] = "dr_grpo", None
    elif bad == "ref_inf":
        ref, opts["beta"] = torch.full((B, T), float("inf")), 0.1
        mask = torch.ones(B, T)
    with pytest.raises(ValueError) as info:
        grpo_loss_reference(logps, old, ref, adv, mask, **opts)
    assert len(str(info.value)) > 10
    if bad in ("logps_1d", "logps_int"):
        return  # the efficient path takes hidden states, not log-probs
    V, H = 11, 4
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H)
    ids = torch.randint(V, (B, T))
    with pytest.raises(ValueError):
        efficient_grpo_loss(hidden, weight, ids, mask, adv, old_logps=old, ref_logps=ref, epilogue="torch", **opts)


TRITON_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from hypothesis import given, settings, HealthCheck
    from tests.test_fuzz import head_inputs, _all_finite
    from grpo_kit.loss.efficient import efficient_grpo_loss
    from grpo_kit.kernels import grpo_epilogue as E
    assert E.interpreter_active()
    n = 0

    @settings(max_examples=int(sys.argv[2]), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(head_inputs())
    def check(inp):
        global n
        hidden, weight, ids, old, ref, adv, mask, opts, temperature, chunk = inp
        out = {}
        for epi in ("torch", "triton"):
            h = hidden.clone().requires_grad_(True)
            loss, _ = efficient_grpo_loss(h, weight, ids, mask, adv, old_logps=old, ref_logps=ref,
                                          temperature=temperature, chunk_size=chunk, epilogue=epi, **opts)
            loss.backward()
            assert _all_finite(loss, h.grad), (epi, loss, h.grad)
            out[epi] = (loss.detach(), h.grad)
        (l0, g0), (l1, g1) = out["torch"], out["triton"]
        assert torch.allclose(l0, l1, rtol=1e-4, atol=1e-5), (l0, l1)
        assert torch.allclose(g0, g1, rtol=1e-3, atol=1e-5 * max(1.0, float(g0.abs().max()))), (g0, g1)
        n += 1

    check()
    print("TRITON-FUZZ-OK", n)
    """
)


def test_triton_epilogue_fuzzed_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    examples = os.environ.get("GRPO_KIT_TRITON_FUZZ_EXAMPLES", "6")
    res = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(ROOT), examples],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0 and "TRITON-FUZZ-OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
