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

__all__ = ["roll_left_pads", "completion_rows"]


def roll_left_pads(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``input_ids`` (B, T) with each row rolled left by its leading pads, and those counts (B,) int64; None when a
    row's mask is not [0 ... 0][1 ... 1][0 ... 0] (a pad between real tokens: keep the mask then)."""
    m = attention_mask.bool()
    T = m.size(1)
    pos = torch.arange(T, device=m.device)
    lead = m.int().argmax(1)  # the first real token (every row has one: its prompt)
    end = lead + m.sum(1)
    if not torch.equal((pos[None] >= lead[:, None]) & (pos[None] < end[:, None]), m):
        return None
    return input_ids.gather(1, (pos[None] + lead[:, None]) % T), lead


def completion_rows(hidden: torch.Tensor, lead: torch.Tensor, completion_len: int) -> torch.Tensor:
    """The rows of ``hidden`` (B, T, H), computed on :func:`roll_left_pads`' layout, that predict the last
    ``completion_len`` tokens of the original layout (the completion): (B, completion_len, H), row t predicting
    completion token t (a copy; with ``lead`` all 0, ``hidden[:, -C - 1:-1]`` is the same rows as a view)."""
    T, C = hidden.size(1), completion_len
    cols = torch.arange(T - C - 1, T - 1, device=hidden.device)[None] - lead[:, None]  # (B, C), >= 0: prompts are
    return hidden.gather(1, cols[..., None].expand(-1, -1, hidden.size(-1)))          # never empty
