"""Every byte count of the VRAM calculator, in one place, each derived in its docstring.

All functions return **bytes** (int or float) and take plain numbers, so the table code in
``estimate.py`` and the published-table reproduction share them. Notation:

* ``L`` decoder layers, ``h`` hidden size, ``I`` MLP intermediate size, ``V`` vocabulary,
  ``q`` = heads x head_dim (query width), ``kv`` = KV heads x head_dim (key/value width),
  ``r`` LoRA rank.
* ``b`` bytes of one activation / weight element in the training dtype (bf16/fp16: 2, fp32: 4);
  ``f`` = 4, the fp32 copies HF's RMSNorm and PEFT's LoRA make of bf16/fp16 inputs.
* ``tokens`` = sequences x tokens per sequence in one forward/backward (a micro-batch).

Per-layer activation counts (:func:`layer_saved_terms`) were derived by reading the HF Llama /
Qwen2 / Mistral decoder layer and PEFT LoRA forward, and are checked in ``tests/test_memory.py``
against the tensors autograd actually saves (``torch.autograd.graph.saved_tensors_hooks``).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_kit.kernels.nf4_dequant import NF4_BITS_PER_PARAM
from grpo_kit.model.fp8 import FP8_DTYPE

GB = 1e9
GiB = 2**30

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
FP32 = 4
FP8_BYTES = FP8_DTYPE.itemsize  # an e4m3 weight (grpo_kit.model.fp8)


@dataclass(frozen=True)
class Arch:
    """The config numbers the calculator needs (from a transformers config)."""

    name: str
    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # A mixture of experts: ``experts`` per layer, ``active_experts`` per token, each of width
    # ``expert_intermediate``; ``intermediate`` is then the per-token MLP width the activations take,
    # active_experts x expert_intermediate. The experts are fused parameters: no LoRA, never quantised.
    experts: int = 0
    active_experts: int = 0
    expert_intermediate: int = 0
    expert_bias: bool = False
    # Parameters the formulas do not name (a family's further norms, QK-norms, attention sinks), counted once from
    # the model's meta-device build (grpo_kit.memory.estimate.arch_from_config); 16-bit, with the embedding.
    extra_params: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_linears(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of the linear layers of one decoder layer: the 7 projections, or
        attention's 4 where the MLP is experts (fused parameters, not linear layers)."""
        h, q, kv, I = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attention = [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h)]
        if self.experts:
            return attention
        return attention + [("gate_proj", h, I), ("up_proj", h, I), ("down_proj", I, h)]

    def expert_params(self) -> int:
        """Parameters of one layer's experts and router: E x (3 h I_e) (+ biases), router h x E."""
        if not self.experts:
            return 0
        h, ie = self.hidden, self.expert_intermediate
        bias = (2 * ie + h) if self.expert_bias else 0
        return self.experts * (3 * h * ie + bias) + self.experts * h


# ----------------------------------------------------------------------------- parameters


def param_counts(a: Arch) -> dict[str, int]:
    """Parameter counts: ``layer_linear`` (the 7 projections of all layers, the part 4-bit
    quantisation applies to), ``experts`` (an MoE's experts and routers, kept 16-bit), ``other`` (embedding,
    untied head, norms, biases), ``total``.

    Per layer: q h*q, k and v h*kv each, o q*h, gate and up h*I each, down I*h; biases where the
    architecture has them (Qwen2: q, k, v); two RMSNorm weights of h. Plus the embedding V*h,
    the head V*h unless tied, the final norm h. Checked against a meta-device model in tests.
    """
    lin = sum(i * o for _, i, o in a.layer_linears()) * a.layers
    bias = 0
    if a.qkv_bias:
        bias += a.q_dim + 2 * a.kv_dim
    if a.o_bias:
        bias += a.hidden
    if a.mlp_bias and not a.experts:
        bias += 2 * a.intermediate + a.hidden
    experts = a.layers * a.expert_params()
    other = (
        a.vocab * a.hidden * (1 if a.tied else 2)
        + a.layers * (2 * a.hidden + bias)
        + a.hidden
        + experts
        + a.extra_params
    )
    return {"layer_linear": lin, "experts": experts, "other": other, "total": lin + other}


def fp8_scale_count(a: Arch) -> int:
    """fp32 scales of FP8 layer projections (grpo_kit.model.fp8, per output channel): one per output row of each
    of the 7 projections of every layer, ``L * (q + 2 kv + h + 2 I + h)``."""
    return a.layers * sum(o for _, _, o in a.layer_linears())


def weight_bytes(a: Arch, b: int, quantization: str | None) -> float:
    """Model weights: ``total * b``; with ``"4bit"`` the layer projections take
    ``NF4_BITS_PER_PARAM / 8`` bytes each (4.127 bits: NF4 + double-quantised absmax) while the
    embedding, head and norms stay in the training dtype (bitsandbytes does not quantise them). With ``"fp8"``
    the layer projections take 1 byte each (e4m3) plus a 4-byte fp32 scale per output channel
    (:func:`fp8_scale_count`); the embedding, head, norms and biases stay in the training dtype.
    """
    n = param_counts(a)
    if quantization is None:
        return n["total"] * b
    if quantization == "4bit":
        return n["layer_linear"] * NF4_BITS_PER_PARAM / 8 + n["other"] * b
    if quantization == "fp8":
        return n["layer_linear"] * FP8_BYTES + fp8_scale_count(a) * FP32 + n["other"] * b
    raise ValueError(f"quantization must be None, '4bit' or 'fp8', got {quantization!r}")


def fp8_matmul_transient_bytes(a: Arch, b: int, rows: int) -> float:
    """The largest transient of one FP8 projection's matmul (grpo_kit.model.fp8), whichever is larger: its
    backward's weight dequantised for ``dx = dy W`` (the largest projection, I x h: an fp32 product rounded to the
    training dtype, ``I h (4 + b)``), or its forward's input quantised per row for W8A8 (the widest input, ``rows``
    x I: an fp32 copy, its fp32 quotient by the row scale and the e4m3 codes, ``rows I (4 + 4 + 1)``)."""
    return max(a.intermediate * a.hidden * (FP32 + b), rows * a.intermediate * (2 * FP32 + FP8_BYTES))


def lora_param_count(a: Arch, r: int) -> int:
    """LoRA on all 7 linear layers of every decoder layer: A is r x in, B is out x r, so
    ``r * (in + out)`` per adapted linear."""
    return a.layers * sum(r * (i + o) for _, i, o in a.layer_linears())


def lora_state_bytes(n_lora: int) -> int:
    """LoRA weights + AdamW states: PEFT keeps adapters in fp32 on a bf16/fp16 base
    (``autocast_adapter_dtype=True``), AdamW adds exp_avg and exp_avg_sq of the same dtype:
    ``3 * 4`` bytes per adapter parameter (their gradients are a separate row)."""
    return n_lora * 3 * FP32


def full_optimizer_bytes(n_params: int, b: int) -> int:
    """Full fine-tuning: torch AdamW allocates exp_avg and exp_avg_sq like each parameter,
    ``2 * b`` bytes per parameter (the weights themselves are the weights row)."""
    return n_params * 2 * b


# ----------------------------------------------------------------------------- activations


def checkpoint_bytes(a: Arch, tokens: int, b: int, n_layers: int) -> int:
    """Gradient-checkpoint inputs: each checkpointed decoder layer keeps its input hidden states,
    ``tokens * h * b`` bytes per layer (cos/sin are shared by all layers and counted with the
    layer, see :func:`layer_saved_terms`)."""
    return n_layers * tokens * a.hidden * b


def final_norm_bytes(a: Arch, tokens: int, b: int, trainable_base: bool) -> int:
    """The final RMSNorm runs outside the checkpointed layers, over every token. HF's RMSNorm
    upcasts: it saves the fp32 input (``f*h``; the input itself when b = 4) and the fp32 rsqrt
    (4 bytes); with a trainable norm weight also the normalised bf16 value (``b*h``)."""
    per_tok = FP32 * a.hidden + FP32 + (b * a.hidden if trainable_base else 0)
    return tokens * per_tok


# Bytes per element of the mask a training dropout saves on CUDA (the fused native_dropout keeps a bool mask; the CPU
# path keeps the noise in the input's dtype instead).
DROPOUT_MASK_BYTES = 1


def layer_saved_terms(
    a: Arch, b: int, lora: bool, lora_dropout: bool = False, mask_bytes: int = DROPOUT_MASK_BYTES
) -> dict[str, dict[str, int]]:
    """Bytes per token that autograd saves inside ONE decoder layer's forward, by tensor.

    Returns ``{"attn": {...}, "mlp": {...}}``: the input-norm / q,k,v / attention part and the
    o_proj / post-norm / MLP part (grpo_kit's checkpointing chunks only the latter). The layer
    input itself is excluded (it is the checkpoint). SDPA / flash attention without a padding
    mask: K and V keep their ``kv`` width (GQA inside SDPA) and no T x T tensor exists.

    Derivation (``f`` = 4, ``new32`` = an fp32 copy exists only when b != 4):

    * RMSNorm ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)``: saves ``x.float()``
      (f*h, new32; for the post-attention norm with b = 4 it is the residual sum itself, still
      f*h), rsqrt (4); a trainable ``w`` also saves the normalised value (b*h), and a trainable
      q/k/v (or gate/up) saves the norm output (b*h).
    * rotary ``q*cos + rotate_half(q)*sin``: saves cos and sin (2 * head_dim * b, shared).
    * SDPA: saves q, k, v after rotary (b*(q + 2kv)), its output (b*q) and the fp32
      log-sum-exp (4 * heads). o_proj's input is a view of that output.
    * MLP ``down(silu(gate(n)) * up(n))``: silu saves gate (b*I), the product saves silu(gate)
      and up (2 b*I); a trainable down saves the product (b*I).
    * LoRA (base frozen, fp32 adapters, dropout 0): frozen projections save nothing, but each
      adapted linear casts its input to fp32 for lora_A (f * in, new32; with b = 4 the shared
      input is saved once) and lora_B saves lora_A's output (4r). The down projection's input is
      therefore saved in fp32 (4I) and the bf16 product is not.
    * LoRA dropout (``lora_dropout``, p > 0 in training): each adapted linear's fp32 input goes through its own
      dropout, so lora_A saves that linear's own dropped copy (no sharing, even at b = 4) and the dropout saves
      its mask (``mask_bytes`` per element: q, k, v and gate, up of width h, o of width q, down of width I).
    """
    h, q, kv, I = a.hidden, a.q_dim, a.kv_dim, a.intermediate
    new32 = b != FP32
    attn: dict[str, int] = {}
    mlp: dict[str, int] = {}
    attn["input_norm fp32 input + rsqrt"] = (FP32 * h if new32 else 0) + FP32
    attn["rotary cos, sin"] = 2 * a.head_dim * b
    attn["sdpa q, k, v"] = b * (q + 2 * kv)
    attn["sdpa output + lse"] = b * q + FP32 * a.heads
    mlp["post_norm fp32 input + rsqrt"] = FP32 * h + FP32
    mlp["silu(gate) input, silu output, up"] = 3 * b * I
    if not lora:
        attn["input_norm normalised + output"] = 2 * b * h
        mlp["post_norm normalised + output"] = 2 * b * h
        mlp["down_proj input"] = b * I
        return {"attn": attn, "mlp": mlp}
    own = new32 or lora_dropout  # each adapted linear saves an input of its own
    attn["lora q, k, v fp32 inputs"] = 3 * FP32 * h if own else b * h
    mlp["lora o fp32 input"] = FP32 * q if own else 0  # b = 4: the SDPA output itself
    mlp["lora gate, up fp32 inputs"] = 2 * FP32 * h if own else b * h
    mlp["lora down fp32 input"] = FP32 * I
    if lora_dropout:
        attn["lora q, k, v dropout masks"] = 3 * mask_bytes * h
        mlp["lora o, gate, up, down dropout masks"] = mask_bytes * (q + 2 * h + I)
    return {"attn": attn, "mlp": mlp}


def layer_saved_bytes_per_token(
    a: Arch, b: int, lora_rank: int | None, lora_dropout: bool = False, mask_bytes: int = DROPOUT_MASK_BYTES
) -> tuple[int, int]:
    """(attention part, MLP part) of :func:`layer_saved_terms`, including the LoRA A outputs
    (4r bytes per adapted linear: 3 in the attention part, 4 in the MLP part)."""
    terms = layer_saved_terms(a, b, lora_rank is not None, lora_dropout and lora_rank is not None, mask_bytes)
    attn, mlp = sum(terms["attn"].values()), sum(terms["mlp"].values())
    if lora_rank is not None:
        attn += 3 * FP32 * lora_rank
        mlp += 4 * FP32 * lora_rank
    return attn, mlp


def mlp_backward_transient_per_token(a: Arch, b: int, lora: bool) -> int:
    """Gradients alive at the MLP backward (the largest moment of one layer's backward),
    bytes per token, approximate: the gradient of the down input (b*I; with LoRA also its fp32
    lora path, f*I), then those of silu(gate) and up (2 b*I) before the saved tensors go."""
    I = a.intermediate
    return 3 * b * I + (FP32 * I if lora else 0)


def full_recompute_peak(
    a: Arch, tokens: int, b: int, lora_rank: int | None, brought_back: int, lora_dropout: bool = False
) -> int:
    """One layer's backward under standard (HF / Unsloth) checkpointing, or grpo_kit's with LoRA dropout (its
    random masks cannot be split into slices): the whole layer is recomputed with grad, so all of
    :func:`layer_saved_bytes_per_token` exists at once, plus the MLP-backward gradients, plus the incoming and
    outgoing hidden-state gradients (2 b*h), plus ``brought_back`` layer inputs (b*h each) copied back from the
    CPU by offloading."""
    attn, mlp = layer_saved_bytes_per_token(a, b, lora_rank, lora_dropout)
    per_tok = attn + mlp + mlp_backward_transient_per_token(a, b, lora_rank is not None) + 2 * b * a.hidden
    return tokens * (per_tok + brought_back * b * a.hidden)


def auto_chunk_tokens(a: Arch) -> int:
    """``grpo_kit.model.offload``'s default slice (``chunk_tokens=None``): the largest power of two
    with tokens x intermediate <= 2**26 elements, clamped to [1024, 16384] (Llama-3.1-8B and
    Qwen2.5-1.5B: 4096). Held equal to ``offload._auto_chunk_tokens`` in tests."""
    t = 1 << max(0, (2**26 // max(a.intermediate, 1)).bit_length() - 1)
    return min(16384, max(1024, t))


def chunked_recompute_peak(
    a: Arch, tokens: int, b: int, lora_rank: int | None, brought_back: int, chunk_tokens: int
) -> int:
    """One layer's backward under ``grpo_kit.model.offload`` (per-token work in slices of
    ``chunk_tokens`` tokens; only attention sees the whole sequence). Per token of the whole
    micro-batch: incoming gradient gy, outgoing gx and ``brought_back`` inputs (b*h each),
    q/k/v recomputed without grad (b*(q+2kv)), the attention output and its gradient (2 b*q),
    the fp32 log-sum-exp (4*heads). Then the larger of two moments:

    * the o_proj + MLP slice loop: + one slice's saved MLP part and MLP-backward gradients;
    * the attention backward: + the q/k/v gradients (b*(q+2kv)) + :func:`attention_backward_workspace`.
    """
    h, q, kv = a.hidden, a.q_dim, a.kv_dim
    base = tokens * (b * h * (2 + brought_back) + b * (q + 2 * kv) + 2 * b * q + FP32 * a.heads)
    _, mlp = layer_saved_bytes_per_token(a, b, lora_rank)
    slice_tok = min(chunk_tokens, tokens)
    loop = slice_tok * (mlp + mlp_backward_transient_per_token(a, b, lora_rank is not None) + 2 * b * h)
    attn_bwd = tokens * (b * (q + 2 * kv) + attention_backward_workspace_per_token(a, b))
    return base + max(loop, attn_bwd)


# ----------------------------------------------------------------------------- prefix sharing


def shared_prefix_tokens(prompt_tokens: int, completion_tokens: int, rows: int, generations: int) -> int:
    """Tokens one forward runs over ``rows`` sequences when each group's prompt runs once
    (``grpo_kit.model.prefix``): ``ceil(rows / generations)`` prompts (a micro-batch of whole groups, or part of
    one) and every row's completion."""
    return -(-rows // generations) * prompt_tokens + rows * completion_tokens


def prefix_kv_bytes(a: Arch, prompt_tokens: int, b: int) -> int:
    """The prompts' keys and values of every layer, which the training pass holds from the prompts' forward
    until each layer's backward (the completions' layers read them, in forward and in their recompute):
    :func:`kv_cache_bytes` of the prompt tokens in the training dtype."""
    return kv_cache_bytes(a, prompt_tokens, b)


def prefix_attention_bytes(
    a: Arch, rows: int, prompt_tokens: int, completion_tokens: int, b: int, with_grad: bool
) -> int:
    """The completions' attention over their group's prompt: the prompt's keys and values expanded to every row
    and joined to the row's own, ``rows x (P + C) x 2 kv x b``; with a 2-D mask (which the completions need,
    their queries sitting after the prompt), transformers' SDPA path then repeats them to every query head
    (``repeat_kv``: ``rows x (P + C) x 2 x heads x head_dim x b`` more where the model groups its query heads).
    With grad, each of them again as its gradient, before the sum over the rows into the one prompt."""
    joined = rows * (prompt_tokens + completion_tokens) * 2 * a.kv_dim * b
    repeated = 0 if a.heads == a.kv_heads else rows * (prompt_tokens + completion_tokens) * 2 * a.q_dim * b
    n = joined + repeated
    return 2 * n if with_grad else n


def prefix_mask_bytes(rows: int, prompt_tokens: int, completion_tokens: int, b: int) -> int:
    """The completions' attention mask: their queries sit after the prompt, so SDPA's own causal flag (aligned to
    the top left) does not fit and transformers passes a boolean (C, P + C) mask, broadcast over the ``rows`` (a
    stride-0 view), which SDPA turns into an additive one in the compute dtype, one per row (the broadcast view
    is made dense): ``C x (P + C) x (1 + rows x b)``."""
    return completion_tokens * (prompt_tokens + completion_tokens) * (1 + rows * b)


def shared_scoring_peak(
    a: Arch,
    rows: int,
    prompt_tokens: int,
    completion_tokens: int,
    b: int,
    chunk_tokens: int | None,
    logits_chunk_bytes: float,
    adapters: bool = False,
) -> float:
    """The no-grad scoring forward of one group with prefix sharing (groups run one after another): the prompt's
    keys and values of every layer, then the larger of the prompt's forward (one sequence of P tokens) and the
    ``rows`` completions' forward (C tokens each) with the prompt's keys and values expanded to every row and
    their mask (:func:`scoring_forward_peak` for each, one logits chunk counted once)."""
    prompt = scoring_forward_peak(a, 1, prompt_tokens, b, chunk_tokens, 0, adapters)
    completions = (
        scoring_forward_peak(a, rows, completion_tokens, b, chunk_tokens, 0, adapters)
        + prefix_attention_bytes(a, rows, prompt_tokens, completion_tokens, b, False)
        + prefix_mask_bytes(rows, prompt_tokens, completion_tokens, b)
    )
    return prefix_kv_bytes(a, prompt_tokens, b) + max(prompt, completions) + logits_chunk_bytes


# fp32 tensors of the intermediate width alive at once in a no-grad MLP forward through PEFT's LoRA layers (fp32
# adapters): the adapter's output, that output scaled, and the sum promoted to fp32, at the up projection while the
# gate's output waits. Measured on the CPU with peft 0.21 (tests/test_memory.py), bf16 and fp32 alike, dropout or not.
ADAPTER_FP32_TEMPS = 4


def scoring_forward_peak(
    a: Arch,
    sequences: int,
    seq_tokens: int,
    b: int,
    chunk_tokens: int | None,
    logits_chunk_bytes: float,
    adapters: bool = False,
) -> float:
    """The no-grad forward that scores ``sequences`` sequences of ``seq_tokens`` tokens at once (the reference
    log-probs), bytes. Alive through the pass: per token the embeddings, a layer's input and its output (3 b*h).
    Then the larger of two moments: attention, with q/k/v (b*(q + 2kv)), its output and that output made
    contiguous (2 b*q; no mask: the kit rolls the pads to the end, grpo_kit.model.causal_layout); or the MLP's gate, up
    and product (3 b*inter) for one slice of ``chunk_tokens`` tokens (None: every token, the unsliced forward that
    LoRA dropout gets). ``adapters``: the pass runs with the LoRA adapters on (TRL's old-policy pass, not the
    reference pass): the MLP's moment is then :data:`ADAPTER_FP32_TEMPS` fp32 intermediates per token where that is
    more. Plus one logits chunk."""
    tokens = sequences * seq_tokens
    attention = tokens * b * (3 * a.q_dim + 2 * a.kv_dim)
    per_token = max(3 * b, ADAPTER_FP32_TEMPS * FP32 if adapters else 0) * a.intermediate
    mlp = (tokens if chunk_tokens is None else min(chunk_tokens, tokens)) * per_token
    return tokens * 3 * b * a.hidden + max(attention, mlp) + logits_chunk_bytes


def attention_backward_workspace_per_token(a: Arch, b: int) -> int:
    """Scratch of the flash-attention backward (FlashAttention-2 as bundled in PyTorch), bytes per
    token: an fp32 dq accumulator (4*q) and, with grouped-query attention, dK and dV expanded to all
    query heads before the sum over each group (2 b*q)."""
    return FP32 * a.q_dim + (2 * b * a.q_dim if a.kv_heads < a.heads else 0)


# ----------------------------------------------------------------------------- loss, generation


def logits_bytes(n_tensors: int, sequences: int, tokens: int, vocab: int, b: int) -> int:
    """``n_tensors`` (sequences, tokens, V) tensors of ``b`` bytes. TRL's bf16 path keeps two:
    the logits (scaled by 1/temperature) and the log-softmax saved for backward; in backward
    their two gradients replace them. The published TRL figure counts two tensors too
    (policy + reference)."""
    return n_tensors * sequences * tokens * vocab * b


def kv_cache_bytes(a: Arch, cached_tokens: int, kv_b: int) -> int:
    """K and V for every layer: ``2 * L * cached_tokens * kv * kv_b`` (GQA: only the KV heads)."""
    return 2 * a.layers * cached_tokens * a.kv_dim * kv_b


VLLM_BLOCK_TOKENS = 16  # vLLM's KV cache block (tokens per block), its CUDA default


def vllm_kv_tokens(
    prompt_tokens: int, completion_tokens: int, generations: int, prompts: int, block: int = VLLM_BLOCK_TOKENS
) -> int:
    """KV cache slots vLLM holds while it generates ``generations`` completions of each of
    ``prompts`` prompts at once: per prompt its full blocks once (prefix caching shares them), then
    per completion the prompt's last partial block (copied, not shared), its own tokens and one
    block of slack for the block being filled, all in whole blocks."""
    full, tail = divmod(prompt_tokens, block)
    per_completion = -(-(tail + completion_tokens) // block) + 1
    return prompts * (full + generations * per_completion) * block


def vllm_workspace_bytes(a: Arch, batched_tokens: int, max_seqs: int, b: int) -> int:
    """vLLM's own activations beside weights and KV cache, at its profile run: one forward over
    ``batched_tokens`` tokens keeps the residual, the norm output, q/k/v, the attention output
    (about ``2h + q + 2kv + q``) and the MLP's gate/up and their product (``3I``) of one layer
    alive, ``b`` bytes each; the sampler holds fp32 logits, probabilities and log-probs
    (``3 x 4 B``) for ``max_seqs`` rows of V. CUDA graphs reuse this pool."""
    per_token = (2 * a.hidden + 2 * a.q_dim + 2 * a.kv_dim + 3 * a.intermediate) * b
    return batched_tokens * per_token + max_seqs * a.vocab * 3 * FP32
