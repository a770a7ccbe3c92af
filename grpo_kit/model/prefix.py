"""Prefix-shared scoring: the G completions of a group that share one prompt attend to one forward of it.

A GRPO group is G completions of one prompt. Scored the usual way, each of the G rows runs the prompt through the
model again: at 8 x (126,976 + 2,048) tokens that is 1.03M tokens a pass where 143,360 carry the information. Here,
per group, the prompt's forward runs once (batch 1) into a :class:`PrefixCache` that records every layer's keys and
values; then the G completions run in one batch, each layer's attention reading the prompt's keys and values
(expanded to G, so that autograd sums the G completions' gradients into the one prompt forward) before their own.
Completion positions continue from the prompt's length; completions are right-padded, so the causal mask alone is
exact for every real token (pads sit after all of them) and no 2-D mask is passed.

Row t of the result predicts completion token t, as the unshared path's ``hidden[:, -C - 1:-1]``: row 0 is the
prompt forward's last position (one row, expanded to G), rows 1.. come from the completion forward, which therefore
runs on the first C - 1 completion tokens only. The head, the logit form (scale, soft-cap) and the loss are applied
afterwards to these rows exactly as to the unshared ones (:mod:`grpo_kit.loss.efficient`), so nothing downstream
knows which path made them.

Which rows share is decided per batch by content (:func:`plan_prefix_groups`): rows whose real prompt tokens (left
padding removed) are equal form a group, wherever they sit (TRL shuffles a generation's rows before it splits them
into micro-batches). A row whose prompt no other row shares, or one whose mask is not TRL's left-padded layout, is
scored the unshared way; the plan counts them so the trainer can say so.

Under the kit's offloaded checkpointing the decoder layers recompute in backward: the wrapper
(:mod:`grpo_kit.model.offload`) then passes a layer's prompt keys and values explicitly, as outputs of the prompt
layer's recompute and inputs of the completion layer's, so a recompute never appends to the cache twice. HF's own
per-layer checkpointing drops any cache in training, so it is paused for the no-grad passes
(:func:`hf_checkpointing_paused`) and refused for the training pass (:func:`hf_checkpointing_drops_cache`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from grpo_kit.model.anatomy import decoder_body, decoder_layers, last_hidden

__all__ = [
    "AUTO_MIN_PROMPT_TOKENS",
    "AUTO_MIN_PROMPT_PER_COMPLETION",
    "PREFIX_SHARING_CHOICES",
    "PrefixCache",
    "PrefixPlan",
    "SharedGroup",
    "check_prefix_sharing",
    "hf_checkpointing_drops_cache",
    "hf_checkpointing_paused",
    "plan_prefix_groups",
    "prefix_shared_hidden",
    "shared_group_hidden",
]

PREFIX_SHARING_CHOICES = ("auto", True, False)
# ``auto`` shares a group where its prompt is at least this long ...
AUTO_MIN_PROMPT_TOKENS = 1024
# ... and at least this many times the group's mean completion length. Sharing saves (G - 1) P of G (P + C) tokens
# per pass; what it costs is fixed per group: a second forward call (launches per layer), a batch-1 prompt forward
# and a G-row completion forward in place of one G-row batch (smaller GEMMs), and the prompt's keys and values
# copied G times per layer. At P = C the saving is (G - 1) / 2G of the work (44% at G = 8), well past those costs;
# at 8 x (512 + 4,096) it would be 10%, about what they cost, so ``auto`` leaves such groups alone, and below
# ~1K prompt tokens per-call overheads decide, not tokens.
AUTO_MIN_PROMPT_PER_COMPLETION = 1.0


def check_prefix_sharing(value):
    """``value`` as the kit takes it (``"auto"``, True or False), or ValueError naming the choices."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if value not in PREFIX_SHARING_CHOICES or (not isinstance(value, bool) and value != "auto"):
        raise ValueError(f"prefix_sharing must be auto, true or false, got {value!r}")
    return value


class PrefixCache(Cache):
    """The keys and values of one prompt, by layer, read by its group's completions.

    ``record`` mode (the prompt's forward): each layer's ``update(k, v, layer_idx)`` keeps k, v (1, kv_heads, P, d)
    as they are (with their autograd history in the training pass) and returns them; a second call for a layer
    replaces them, so recording is idempotent. ``attend`` mode (the completions' forward, G rows): ``update``
    returns the prompt's keys and values expanded to G and followed by the completions' own, (G, kv_heads, P + C,
    d), and stores nothing, so a recompute reads the same states. Sequence length, query offset and mask sizes are
    those of a cache holding P tokens while attending, of an empty one while recording. Every layer keeps the whole
    prompt: a sliding window is the mask's business (HF builds it from these sizes), not the cache's.
    """

    def __init__(self):
        super().__init__(layers=[])
        self.mode = "record"
        self.length = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(self) -> PrefixCache:
        """Switch to reading: the recorded prompt is ``length`` tokens long."""
        if not self.keys:
            raise RuntimeError("PrefixCache.attend: nothing recorded (run the prompt's forward first)")
        self.length = next(iter(self.keys.values())).shape[-2]
        self.mode = "attend"
        return self

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.mode == "record":
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
            return key_states, value_states
        k, v = self.keys[layer_idx], self.values[layer_idx]
        rows = key_states.shape[0]
        return (
            torch.cat([k.expand(rows, -1, -1, -1), key_states], dim=-2),
            torch.cat([v.expand(rows, -1, -1, -1), value_states], dim=-2),
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length if self.mode == "attend" else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1


# ----------------------------------------------------------------------------- which rows share


@dataclass(frozen=True)
class SharedGroup:
    """Rows of a batch whose real prompt tokens are equal: their indices and that prompt, (P,) int64 on the
    batch's device."""

    rows: tuple[int, ...]
    prompt: torch.Tensor


@dataclass(frozen=True)
class PrefixPlan:
    """How a batch is scored: ``groups`` share their prompt's forward, ``unshared`` rows (indices) run the usual
    way. ``alone``: rows whose prompt no other row of the batch has (a group whose prompts differ lands here);
    ``short``: rows of groups ``auto`` left unshared (prompt too short to pay); ``layout``: rows whose mask is
    not left padding then real tokens."""

    groups: tuple[SharedGroup, ...]
    unshared: tuple[int, ...]
    alone: int = 0
    short: int = 0
    layout: int = 0

    @property
    def shared_rows(self) -> int:
        return sum(len(g.rows) for g in self.groups)

    @property
    def tokens_saved(self) -> int:
        """Prompt tokens not run again: (rows - 1) * P per group."""
        return sum((len(g.rows) - 1) * g.prompt.numel() for g in self.groups)


def _pays(prompt_len: int, completion_tokens: float) -> bool:
    return prompt_len >= max(AUTO_MIN_PROMPT_TOKENS, AUTO_MIN_PROMPT_PER_COMPLETION * completion_tokens)


def plan_prefix_groups(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask=None, *, mode="auto"
) -> PrefixPlan:
    """Group the rows of a batch by their real prompt tokens.

    prompt_ids, prompt_mask: (B, P) int, TRL's left-padded prompts; completion_mask: (B, C) or None (then ``auto``
    reads completions as 0 tokens long); ``mode``: True shares every group of two or more rows, ``"auto"`` those
    whose prompt pays (:data:`AUTO_MIN_PROMPT_TOKENS`, :data:`AUTO_MIN_PROMPT_PER_COMPLETION`), False none. One
    copy of the prompts to the host.
    """
    mode = check_prefix_sharing(mode)
    B = prompt_ids.shape[0]
    if mode is False or B < 2:
        return PrefixPlan((), tuple(range(B)))
    ids, mask = prompt_ids.detach().cpu(), prompt_mask.detach().cpu().bool()
    lengths = (
        completion_mask.detach().cpu().float().sum(1) if completion_mask is not None else torch.zeros(B)
    ).tolist()
    P = ids.shape[1]
    real = mask.sum(1)
    left_padded = mask.eq(torch.arange(P)[None] >= (P - real)[:, None]).all(1)
    by_prompt: dict[bytes, list[int]] = {}
    unshared, layout = [], 0
    for row in range(B):
        if not bool(left_padded[row]) or int(real[row]) == 0:
            unshared.append(row)
            layout += 1
            continue
        key = ids[row, P - int(real[row]) :].numpy().tobytes()
        by_prompt.setdefault(key, []).append(row)
    groups, alone, short = [], 0, 0
    for rows in by_prompt.values():
        n_real = int(real[rows[0]])
        if mode == "auto" and not _pays(n_real, sum(lengths[r] for r in rows) / len(rows)):
            short += len(rows)  # a lone row too: it would not have shared, so it is not said to fall back
        elif len(rows) < 2:
            alone += 1
        else:
            groups.append(SharedGroup(tuple(rows), prompt_ids[rows[0], P - n_real :]))
            continue
        unshared.extend(rows)
    return PrefixPlan(tuple(groups), tuple(sorted(unshared)), alone=alone, short=short, layout=layout)


# ----------------------------------------------------------------------------- HF's checkpointing


def hf_checkpointing_drops_cache(model: nn.Module) -> bool:
    """Whether HF's per-layer gradient checkpointing is on for a layer in training: its ``__call__`` then sets
    ``past_key_values=None`` (a recompute would append to a cache twice), so the completions would not see the
    prompt at all."""
    return any(
        getattr(layer, "gradient_checkpointing", False)
        and layer.training
        and not getattr(layer, "_can_checkpoint_with_cache", False)
        for layer in decoder_layers(model)
    )


@contextlib.contextmanager
def hf_checkpointing_paused(model: nn.Module):
    """HF's per-layer checkpointing flags off for the block (a no-grad pass saves nothing to recompute anyway),
    then back as they were."""
    layers = [layer for layer in decoder_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


# ----------------------------------------------------------------------------- the shared forward


@contextlib.contextmanager
def _body_output(model: nn.Module):
    box: list = []
    handle = decoder_body(model).register_forward_hook(lambda _m, _i, out: box.append(out))
    try:
        yield box
    finally:
        handle.remove()


def shared_group_hidden(model: nn.Module, prompt: torch.Tensor, completion_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states of G completions of one prompt, the prompt's forward run once.

    model: a causal LM (or its PEFT / DDP wrapper), called through its own forward with ``logits_to_keep=1``;
    prompt: (P,) int, the real tokens; completion_ids: (G, C) int, right-padded. Returns (G, C, H) in the body's
    output dtype, row t predicting completion token t; gradients (where grad is on) reach the prompt's forward
    once, summed over the G completions.
    """
    if torch.is_grad_enabled() and hf_checkpointing_drops_cache(model):
        raise ValueError(
            "prefix sharing in a training pass needs HF's gradient checkpointing off (it drops the "
            "KV cache in training); the kit's offloaded checkpointing keeps it"
        )
    G, C = completion_ids.shape
    cache = PrefixCache()
    with _body_output(model) as box:
        model(input_ids=prompt.reshape(1, -1), past_key_values=cache, use_cache=True, logits_to_keep=1)
    first = last_hidden(box[-1])[:, -1:]  # (1, 1, H): predicts completion token 0 of every row
    rows = [first.expand(G, 1, first.shape[-1])]
    if C > 1:  # the last completion token predicts nothing
        cache.attend()
        with _body_output(model) as box:
            model(input_ids=completion_ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        rows.append(last_hidden(box[-1]))
    return torch.cat(rows, dim=1)


def prefix_shared_hidden(model: nn.Module, plan: PrefixPlan, completion_ids: torch.Tensor, unshared) -> torch.Tensor:
    """(B, C, H) final hidden states of a batch scored by ``plan``: each group by :func:`shared_group_hidden`, the
    unshared rows by ``unshared(rows)`` (rows: (n,) int64 indices; returns their (n, C, H) the usual way), put
    back in the batch's row order (an index_select, so gradients flow to every piece)."""
    pieces, order = [], []
    for group in plan.groups:
        pieces.append(shared_group_hidden(model, group.prompt, completion_ids[list(group.rows)]))
        order.extend(group.rows)
    if plan.unshared:
        rows = torch.tensor(plan.unshared, dtype=torch.long, device=completion_ids.device)
        pieces.append(unshared(rows))
        order.extend(plan.unshared)
    dtype = pieces[0].dtype
    hidden = torch.cat([p.to(dtype) for p in pieces], dim=0)
    if order == sorted(order):
        return hidden
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return hidden.index_select(0, inverse.to(hidden.device))
