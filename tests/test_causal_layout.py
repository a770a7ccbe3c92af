"""grpo_kit.model.causal_layout: TRL's padded GRPO batches rolled so that the causal mask alone reads them. The rolled
layout, the rows that predict the completion, the same hidden states as the masked forward (Llama and Qwen2), and
no (B, 1, T, T) mask built on the way."""

import pytest
import torch

from grpo_kit.model.causal_layout import completion_rows, roll_left_pads
from grpo_kit.model.loading import load_model

# three rows as TRL lays them out: left-padded prompts (P = 4), right-padded completions (C = 5)
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 0, 0, 0]])
C = 5


def test_rows_roll_left_by_their_leading_pads():
    ids = torch.arange(27).reshape(3, 9)
    rolled, lead, moved = roll_left_pads(ids, MASK, 4)
    assert lead.tolist() == [2, 0, 3] and moved
    assert rolled[0].tolist() == [2, 3, 4, 5, 6, 7, 8, 0, 1] and torch.equal(rolled[1], ids[1])
    assert rolled[2].tolist() == [21, 22, 23, 24, 25, 26, 18, 19, 20]
    # every real token now comes before every pad: the causal mask is exact for them
    assert all(
        torch.equal(r.gather(0, torch.arange(int(m.sum()))), ids[i][m.bool()])
        for i, (r, m) in enumerate(zip(rolled, MASK))
    )


def test_a_pad_between_real_tokens_keeps_the_mask():
    hole = MASK.clone()
    hole[1, 4] = 0
    assert roll_left_pads(torch.zeros(3, 9, dtype=torch.long), hole, 4) is None


def test_an_empty_prompt_keeps_the_mask_and_no_padding_keeps_the_layout():
    """A row with no real prompt token (nothing predicts its first completion token) keeps the mask; rows with
    only trailing pads need no roll."""
    empty = MASK.clone()
    empty[2, :4] = 0
    ids = torch.arange(27).reshape(3, 9)
    assert roll_left_pads(ids, empty, 4) is None
    trailing = torch.tensor([[1] * 7 + [0, 0], [1] * 9])
    two = ids[:2]
    same, lead, moved = roll_left_pads(two, trailing, 4)
    assert same is two and lead.tolist() == [0, 0] and not moved


def test_completion_rows_pick_the_rows_before_each_completion_token():
    hidden = torch.arange(27.0).reshape(3, 9, 1) * 10  # row t of the rolled layout holds 10 * (9 * b + t)
    _, lead, _ = roll_left_pads(torch.zeros(3, 9, dtype=torch.long), MASK, 4)
    rows = completion_rows(hidden, lead, C)[..., 0]
    # completion token j sits at column 4 + j originally, 4 + j - lead after the roll; its predictor one before
    for b in range(3):
        assert rows[b].tolist() == [10 * (9 * b + 3 + j - int(lead[b])) for j in range(C)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_the_rolled_unmasked_forward_gives_the_masked_forwards_hidden_states(name, monkeypatch):
    import transformers.integrations.sdpa_attention as sd
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, _ = load_model(name)
    model.eval()
    ids = torch.randint(3, 1000, MASK.shape, generator=torch.Generator().manual_seed(0))
    norm = model.model.norm
    box = []
    handle = norm.register_forward_hook(lambda _m, _i, out: box.append(out))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=MASK, use_cache=False)
        rolled, lead, _ = roll_left_pads(ids, MASK, 4)
        masks = []
        real = sd.sdpa_attention_forward
        monkeypatch.setattr(
            sd,
            "sdpa_attention_forward",
            lambda m, q, k, v, attention_mask, **kw: masks.append(attention_mask)
            or real(m, q, k, v, attention_mask, **kw),
        )
        model.config._attn_implementation = "sdpa"
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", sd.sdpa_attention_forward)
        model(input_ids=rolled, attention_mask=None, use_cache=False)
    handle.remove()
    assert masks and all(m is None for m in masks)  # no (B, 1, T, T) mask on the rolled layout
    want = box[0][:, -C - 1 : -1]
    got = completion_rows(box[1], lead, C)
    real_rows = MASK[:, -C - 1 : -1].bool()  # rows of real tokens (a pad's row is never read)
    torch.testing.assert_close(got[real_rows], want[real_rows], rtol=1e-4, atol=1e-5)


def test_completion_rows_backward_keeps_no_copy_of_the_hidden_states():
    hidden = torch.randn(3, 9, 4, requires_grad=True)
    _, lead, _ = roll_left_pads(torch.zeros(3, 9, dtype=torch.long), MASK, 4)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rows = completion_rows(hidden, lead, C)
    assert all(t.data_ptr() != hidden.data_ptr() and t.numel() < hidden.numel() for t in saved)
    rows.sum().backward()
    assert hidden.grad.sum() == 3 * C * 4  # each picked row once
