"""GRPO batches laid out so that the causal mask alone reads them: no (B, 1, T, T) attention mask.

TRL lays a batch out as left-padded prompts, then right-padded completions, and passes the 0/1 attention mask.
With any padding in it, transformers turns that mask into a (B, 1, T, T) boolean tensor for SDPA and eager
attention, and SDPA makes an additive copy in the compute dtype per call: (1 + 2) T^2 bytes per fp16 sequence
(1.3 GB at 21K tokens, 12.8 GB at 65K), which no other memory figure of the step comes near at long context, and
attention leaves its flash kernel. Rolling each row left by its count of leading pads moves every pad to the
end: each real token then has only real tokens before it, so the plain causal mask is exact for them and the
model runs without a mask (the pads' own outputs are never read). Positions then start at 0 on each row's first
real token, as in generation; RoPE scores depend on position differences only, so only rounding changes.
"""

from __future__ import annotations

import torch

__all__ = ["MASK_BUILDING_ATTENTION", "roll_left_pads", "completion_rows"]
# transformers' attention implementations that turn a padded 2-D mask into a (B, 1, T, T) one; flash attention
# unpads it instead (varlen), so rolling gains nothing there and would make it attend over the pads
MASK_BUILDING_ATTENTION = ("sdpa", "eager")


def roll_left_pads(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``input_ids`` (B, T) with each row rolled left by its leading pads, those counts (B,) int64, and whether any
    row moved; None where the layout needs the mask: a row whose mask is not [0 ... 0][1 ... 1][0 ... 0] (a pad
    between real tokens), or an empty prompt (no real token in the first ``prompt_width`` columns, so nothing
    predicts its first completion token). One wait for the device."""
    m = attention_mask.bool()
    T = m.size(1)
    pos = torch.arange(T, device=m.device)
    lead = m.int().argmax(1)  # the first real token
    end = lead + m.sum(1)
    contiguous = ((pos[None] >= lead[:, None]) & (pos[None] < end[:, None])).eq(m).all()
    contiguous, prompts, moved = torch.stack([contiguous, (lead < prompt_width).all(), lead.gt(0).any()]).tolist()
    if not (contiguous and prompts):
        return None
    if not moved:
        return input_ids, lead, False
    return input_ids.gather(1, (pos[None] + lead[:, None]) % T), lead, True


def completion_rows(hidden: torch.Tensor, lead: torch.Tensor, completion_len: int) -> torch.Tensor:
    """The rows of ``hidden`` (B, T, H), computed on :func:`roll_left_pads`' layout, that predict the last
    ``completion_len`` tokens of the original layout (the completion): (B, completion_len, H), row t predicting
    completion token t. A copy (with ``lead`` all 0, ``hidden[:, -C - 1:-1]`` is the same rows as a view); its
    backward keeps the indices, not ``hidden``."""
    B, T, C = hidden.size(0), hidden.size(1), completion_len
    cols = torch.arange(T - C - 1, T - 1, device=hidden.device)[None] - lead[:, None]  # (B, C), >= 0 (non-empty
    return hidden[torch.arange(B, device=hidden.device)[:, None], cols]  # prompts)
