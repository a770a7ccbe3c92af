"""What the parity tests against stock TRL share: one fixed batch's reference log-probs, the same from both trainers."""

import torch


def check_reference_and_fill(stock, ours, inputs, gen) -> None:
    """Both trainers' reference log-probs (adapter off) of ``inputs``' prompt + completion, equal where the
    completion mask is on; then ``inputs`` gets TRL's ``ref_per_token_logps`` and old log-probs 0.1 away from them
    (so that clipping is exercised), and both trainers two accumulated micro-batches per generation."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    cm = inputs["completion_mask"].bool()
    with torch.no_grad():
        with stock.model.disable_adapter():
            ref_stock = stock._get_per_token_logps_and_entropies(stock.model, ids, am, C)[0]
        with ours.model.disable_adapter():
            ref_ours = ours._get_per_token_logps_and_entropies(ours.model, ids, am, C)[0]
    torch.testing.assert_close(ref_ours[cm], ref_stock[cm], rtol=1e-5, atol=1e-5)
    inputs["ref_per_token_logps"] = ref_stock
    inputs["old_per_token_logps"] = ref_stock + 0.1 * torch.randn(ref_stock.shape, generator=gen)
    for t in (stock, ours):
        t.current_gradient_accumulation_steps = 2
        t.args.steps_per_generation = 2
