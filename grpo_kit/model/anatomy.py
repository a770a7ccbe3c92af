"""What the kit needs from a causal LM, found from the model itself, for any family: no code per model class.

* the decoder body (``get_decoder()``) and its layers: every transformers ``GradientCheckpointingLayer`` inside it
  (the class transformers itself recomputes under gradient checkpointing), else the modules named by the model's
  ``_no_split_modules``;
* the head: ``get_output_embeddings()`` (weight (V, H), bias (V,) or None; tied or not) applied to the body's output
  ``last_hidden_state`` (the final norm already applied);
* how the logits are formed from ``h @ W^T + b``: a scale and a soft-cap read from the config
  (:func:`logit_form`) and held against the model's own logits by :func:`check_logit_form`;
* the linear projections LoRA can target (:func:`lora_targets`): every ``nn.Linear`` of the decoder layers but
  routers, the head excluded;
* whether it is a mixture of experts whose router's load-balancing loss TRL adds (:func:`router_aux_coef`).

:func:`inspect_config` runs all of this on a meta-device model built from a config (no weights, no memory), so that
a layout the kit cannot map is refused before anything loads, in one line naming what was not found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


class AnatomyError(ValueError):
    """A model whose layout the kit cannot map; the message names what was not found."""


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under DDP / accelerate (``.module``) and PEFT (``get_base_model()``) wrappers."""
    m = model
    while hasattr(m, "module") and isinstance(m.module, nn.Module):
        m = m.module
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    return m


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder body (``LlamaModel``, ``Gemma3TextModel``, ...): its output's ``last_hidden_state`` is the final
    normed hidden states (B, T, H) the head reads."""
    lm = causal_lm(model)
    body = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if not isinstance(body, nn.Module) or body is lm:
        raise AnatomyError(f"{type(lm).__name__}: no decoder body (get_decoder() found none)")
    return body


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, in order: transformers' ``GradientCheckpointingLayer`` modules of the body (not nested
    in one another), else the modules whose class ``_no_split_modules`` names."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # lazy: transformers is slow to import

    body = decoder_body(model)
    layers = _outermost(body, lambda m: isinstance(m, GradientCheckpointingLayer))
    if not layers:
        names = set(getattr(causal_lm(model), "_no_split_modules", None) or ())
        layers = _outermost(body, lambda m: type(m).__name__ in names)
    if not layers:
        raise AnatomyError(
            f"{type(causal_lm(model)).__name__}: no decoder layers (neither transformers' "
            "GradientCheckpointingLayer modules nor its _no_split_modules classes in the body)"
        )
    return layers


def _outermost(root: nn.Module, pick) -> list[nn.Module]:
    out, stack = [], [root]
    while stack:
        m = stack.pop()
        if m is not root and pick(m):
            out.append(m)
            continue
        stack.extend(reversed(list(m.children())))
    return out


def head(model: nn.Module) -> nn.Module:
    """The output embedding (``get_output_embeddings()``), a module with ``weight`` (V, H) and ``bias`` or None."""
    lm = causal_lm(model)
    out = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not isinstance(getattr(out, "weight", None), torch.Tensor):
        raise AnatomyError(f"{type(lm).__name__}: no output head (get_output_embeddings() has no weight)")
    return out


# ----------------------------------------------------------------------------- the logit form


@dataclass(frozen=True)
class LogitForm:
    """How a model turns ``z = h @ W^T + b`` into its logits: ``z * scale``, then, when ``softcap`` is set,
    ``softcap * tanh(z / softcap)``. Plain (scale 1, no cap) for most families; Granite scales by
    ``1 / logits_scaling``; Gemma 2 (and Gemma 3 checkpoints that set it) soft-caps."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """The logits from ``z`` (any shape), in ``z``'s dtype (the cap computed in fp32)."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = (torch.tanh(z.float() / self.softcap) * self.softcap).to(z.dtype)
        return z

    def describe(self) -> str:
        parts = [f"x {self.scale:g}"] if self.scale != 1.0 else []
        parts += [f"soft-cap {self.softcap:g}"] if self.softcap is not None else []
        return "h @ W^T" + (" then " + ", ".join(parts) if parts else "")


# Config fields that scale the logits, in the order a model's forward reads them (the first one set wins), and
# whether the value multiplies or divides. These are the fields TRL 1.16's fused log-prob head reads as well.
LOGIT_SCALE_FIELDS = (
    ("logit_scale", "multiply"),
    ("output_multiplier", "multiply"),
    ("lm_head_multiplier", "multiply"),
    ("logits_scaling", "divide"),
)
LOGIT_SOFTCAP_FIELD = "final_logit_softcapping"


def logit_form(config) -> LogitForm:
    """The :class:`LogitForm` a transformers config declares (its text config for multimodal ones)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    for name, how in LOGIT_SCALE_FIELDS:
        value = getattr(cfg, name, None)
        if value is not None:
            value = float(value)
            if not math.isfinite(value) or value == 0:
                raise AnatomyError(f"{name}={value!r} in the model config: the logits would not be finite")
            scale = value if how == "multiply" else 1.0 / value
            break
    cap = getattr(cfg, LOGIT_SOFTCAP_FIELD, None)
    if cap is not None and (not math.isfinite(float(cap)) or float(cap) <= 0):
        raise AnatomyError(f"{LOGIT_SOFTCAP_FIELD}={cap!r} in the model config: must be a positive number or null")
    return LogitForm(scale=scale, softcap=None if cap is None else float(cap))


@torch.no_grad()
def check_logit_form(model: nn.Module, form: LogitForm, *, tokens: int = 6) -> float:
    """Hold ``form`` against the model's own logits: one forward over ``tokens`` token ids, its last-position
    logits against ``form.apply(h @ W^T + b)`` from the body's output. Returns the largest difference relative to
    the logits' spread; raises :class:`AnatomyError` where it is over the dtype's tolerance (a logit transform the
    kit does not know: training would use log-probs other than the model's)."""
    lm = causal_lm(model)
    body, out = decoder_body(lm), head(lm)
    device = out.weight.device
    ids = torch.arange(1, tokens + 1, device=device).remainder(out.weight.shape[0]).unsqueeze(0)
    box = []
    handle = body.register_forward_hook(lambda _m, _i, o: box.append(o))
    try:
        logits = lm(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    finally:
        handle.remove()
    h = last_hidden(box[-1])[:, -1].to(out.weight.dtype)
    z = h @ out.weight.t() if getattr(out, "bias", None) is None else torch.addmm(out.bias, h, out.weight.t())
    ours = form.apply(z).float()
    spread = float(logits.std().clamp_min(1e-6))
    gap = float((ours - logits).abs().max()) / spread
    tol = 1e-4 if out.weight.dtype == torch.float32 else 5e-2
    if not math.isfinite(gap) or gap > tol:
        raise AnatomyError(
            f"{type(lm).__name__}: its logits are not {form.describe()} (max difference {gap:.3g} "
            "of their spread): a logit transform the kit does not know; training on these log-probs "
            "would not be the model's"
        )
    return gap


def last_hidden(output):
    """The body's output hidden states: ``last_hidden_state`` of a model output, or its first element."""
    if isinstance(output, torch.Tensor):
        return output
    value = getattr(output, "last_hidden_state", None)
    return value if value is not None else output[0]


# ----------------------------------------------------------------------------- LoRA targets and routers


def _is_router(name: str, module: nn.Linear) -> bool:
    """A router or gate scoring experts (or a shared expert's 1-wide gate): frozen, never a LoRA target."""
    leaf = name.rsplit(".", 1)[-1]
    return "router" in name or module.out_features == 1 or (leaf == "gate" and module.out_features < module.in_features)


def lora_targets(model: nn.Module) -> list[str]:
    """Leaf names of every linear projection of the decoder layers (attention, MLP, linear attention), routers
    excluded; the head and embeddings are outside the layers. Sorted; what PEFT's ``target_modules`` takes.
    Fused MoE experts are parameters, not ``nn.Linear`` layers, so they are not among them."""
    names = set()
    for layer in decoder_layers(model):
        for name, m in layer.named_modules():
            if isinstance(m, nn.Linear) and not _is_router(name, m):
                names.add(name.rsplit(".", 1)[-1])
    if not names:
        raise AnatomyError(
            f"{type(causal_lm(model)).__name__}: no linear projections in its decoder layers for LoRA to target"
        )
    return sorted(names)


# Layer types whose outputs depend on the positions' order only through attention (a mask moved with the pads).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def attention_only(config) -> bool:
    """Whether every layer is attention (``layer_types``; none listed: all are). A hybrid's linear-attention or
    state-space layers run a recurrence in chunks of positions, so moving a row's pads changes their sums' order."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return all(t in ATTENTION_LAYER_TYPES for t in (getattr(cfg, "layer_types", None) or ()))


def resolve_lora_targets(targets, model) -> tuple[str, ...]:
    """A run's LoRA target names: ``"auto"``, every projection of ``model``'s decoder layers (:func:`lora_targets`;
    a meta-device model is enough); a list, each checked to name a module of ``model``."""
    if targets == "auto":
        return tuple(lora_targets(model))
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"lora_target_modules {missing} do not exist in {type(model).__name__}; its linear layers are: {linear}"
        )
    return tuple(targets)


def router_aux_coef(config) -> float:
    """The coefficient of the MoE load-balancing loss that TRL 1.16 adds to the GRPO loss: the config's
    ``router_aux_loss_coef`` where it returns router logits (``output_router_logits`` present), else 0."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(cfg, "output_router_logits"):
        return 0.0
    return float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)


def router_balance_loss(router_logits, config, attention_mask=None) -> torch.Tensor:
    """The MoE load-balancing loss (Switch Transformer's, as transformers' MoE models and TRL 1.16 compute it) of
    the routers' logits of one forward (a tuple, one (tokens, experts) tensor per layer), over the tokens that
    ``attention_mask`` (B, T) keeps, in the order the forward saw them."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # lazy: slow to import

    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return load_balancing_loss_func(router_logits, num_experts(config), cfg.num_experts_per_tok, attention_mask)


def num_experts(config) -> int:
    """Experts per MoE layer (0 for a dense model)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


# ----------------------------------------------------------------------------- before loading


@dataclass(frozen=True)
class Anatomy:
    """What :func:`inspect_config` found in a model's layout (no weights)."""

    model_class: str
    layer_class: str
    layers: int
    logit_form: LogitForm
    lora_targets: tuple[str, ...]
    experts: int
    tied: bool


def inspect_config(config) -> Anatomy:
    """The kit's view of the model ``config`` describes, from a meta-device build (no memory, no weights); an
    :class:`AnatomyError` naming what was not found where the layout cannot be mapped."""
    from grpo_kit.model.loading import meta_model  # loading imports this module's neighbours; late to keep it light

    model = meta_model(config)
    layers = decoder_layers(model)
    head(model)
    form = logit_form(config)
    return Anatomy(
        model_class=type(model).__name__,
        layer_class=type(layers[0]).__name__,
        layers=len(layers),
        logit_form=form,
        lora_targets=tuple(lora_targets(model)),
        experts=num_experts(config),
        tied=bool(
            getattr(
                config.get_text_config() if hasattr(config, "get_text_config") else config, "tie_word_embeddings", False
            )
        ),
    )
