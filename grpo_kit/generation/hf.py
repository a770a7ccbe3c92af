"""``HFGenerator``: transformers ``generate`` with per-token sampling log-probs.

The sampling transforms (temperature, min-p, top-k, top-p, in vLLM's order) are applied
by :func:`process_logits`, run as the last logits processor inside ``generate``, so the
distribution that is sampled from is exactly the one whose log-probs are recorded; HF's
own warpers are switched off. The recorder keeps one ``(rows, vocab)`` fp32 log-softmax
at a time, never the whole ``(rows, steps, vocab)`` score history.

:func:`sampling_logprobs_reference` is the plain version (one full forward over prompt
+ completion, no KV cache); tests hold the two equal.
"""

from __future__ import annotations

import time

import torch

from grpo_kit.generation.base import (
    GenerationResult,
    SamplingConfig,
    check_context,
    check_num_generations,
    cut_at_stop,
    encode_prompts,
)


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Sampling transforms on fp32 logits ``(rows, vocab)``; masked entries become ``-inf``.

    Greedy (temperature 0) leaves the logits unchanged, as vLLM does for its log-probs.
    Order as vLLM's sampler: temperature, min-p, top-k, top-p.
    """
    if sampling.greedy:
        return logits
    x = logits / sampling.temperature
    if sampling.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        threshold = sampling.min_p * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < threshold, float("-inf"))
    if 0 < sampling.top_k < x.size(-1):
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cumulative = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - sampling.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x


class _SampledTokenLogprobs:
    """Logits processor: applies :func:`process_logits`, then records the sampled tokens' log-probs.

    At call t it sees the token sampled at step t-1 as ``input_ids[:, -1]`` and gathers its
    log-prob from the distribution kept from step t-1; :meth:`finish` gathers the last one.
    """

    def __init__(self, sampling: SamplingConfig):
        self.sampling = sampling
        self.prev: torch.Tensor | None = None  # (rows, vocab) fp32 log-softmax of the last step
        self.steps: list[torch.Tensor] = []  # each (rows,) fp32

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        processed = process_logits(scores.float(), self.sampling)
        self.prev = torch.log_softmax(processed, dim=-1)
        return processed

    def finish(self, last_tokens: torch.LongTensor) -> torch.Tensor:
        """(rows, steps) fp32 log-probs of all sampled tokens."""
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
            self.prev = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(len(last_tokens), 0)


def _eos_ids(tokenizer, model) -> list[int]:
    ids = []
    for src in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        for t in src if isinstance(src, (list, tuple)) else [src]:
            if t is not None and t not in ids:
                ids.append(int(t))
    return ids


def _unwrap(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP / accelerate
        model = model.module
    return model


class HFGenerator:
    """Generation with the training model itself through transformers ``generate``.

    ``model``: a ``*ForCausalLM`` (PEFT-wrapped is fine); it may be given later through
    :meth:`sync_weights`, which only points the generator at the model (the weights are
    shared, so there is nothing to copy). ``tokenizer``: for string prompts, decoding and
    the default stop token (EOS). ``batch_size``: rows per ``generate`` call (None: all).
    """

    name = "hf"

    def __init__(self, model=None, tokenizer=None, *, batch_size: int | None = None):
        if tokenizer is None:
            raise ValueError("HFGenerator needs a tokenizer (decoding, padding, EOS)")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size={batch_size!r} is not allowed: None or an integer >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.syncs = 0

    # -- protocol -------------------------------------------------------------------------
    def generate(self, prompts, num_generations: int = 1, sampling: SamplingConfig | None = None) -> GenerationResult:
        if self.model is None:
            raise ValueError("HFGenerator has no model: pass model= or call sync_weights(model) first")
        sampling = sampling or SamplingConfig()
        num_generations = check_num_generations(num_generations)
        model = _unwrap(self.model)
        config = model.config
        prompt_ids = encode_prompts(self.tokenizer, prompts, vocab_size=config.vocab_size)
        max_len = getattr(config, "max_position_embeddings", None)
        if max_len:
            check_context(prompt_ids, sampling.max_tokens, max_len, "the model's max_position_embeddings")
        stop = list(sampling.stop_token_ids) or _eos_ids(self.tokenizer, model)
        rows = [p for p in prompt_ids for _ in range(num_generations)]
        step = self.batch_size or len(rows)
        start = time.perf_counter()
        completions, logprobs = [], []
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                for i in range(0, len(rows), step):
                    ids, lps = self._generate_rows(model, rows[i : i + step], sampling, stop)
                    completions += ids
                    logprobs += lps
        finally:
            model.train(was_training)
        cut = [cut_at_stop(c, stop) for c in completions]
        completion_ids = [c for c, _ in cut]
        logprobs = [lp[: len(c)].contiguous() for lp, c in zip(logprobs, completion_ids)]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return GenerationResult(
            prompt_ids=rows,
            completion_ids=completion_ids,
            texts=texts,
            logprobs=logprobs,
            finish_reasons=[r for _, r in cut],
            num_generations=num_generations,
            timings={"generate_s": time.perf_counter() - start},
        )

    def _generate_rows(self, model, rows, sampling, stop):
        from transformers import GenerationConfig, LogitsProcessorList  # lazy: transformers is slow to import

        device = next(model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stop[0]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):  # left padding
            input_ids[j, width - len(r) :] = torch.tensor(r)
            attention_mask[j, width - len(r) :] = 1
        recorder = _SampledTokenLogprobs(sampling)
        # HF's own warpers stay off (neutral values): ours run inside the recorder, so the
        # recorded distribution is the sampled one.
        neutral = {} if sampling.greedy else dict(temperature=1.0, top_k=0, top_p=1.0, min_p=None)
        config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=not sampling.greedy,
            min_new_tokens=sampling.min_tokens or None,
            eos_token_id=stop,
            pad_token_id=pad,
            use_cache=True,
            **neutral,
        )
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
        )
        new = out[:, width:].cpu()
        lps = recorder.finish(out[:, -1]).cpu()
        return [r.tolist() for r in new], [lp.float() for lp in lps]

    def sync_weights(self, model=None) -> dict:
        """Point the generator at ``model`` (shared weights: nothing is copied)."""
        if model is not None:
            self.model = model
        self.syncs += 1
        return {"mode": "shared", "seconds": 0.0}

    needs_sync = False  # generates with the training model itself

    def sleep(self) -> bool:
        return False

    def wake(self) -> bool:
        return False

    def close(self) -> None:
        self.model = None

    def options(self) -> dict:
        return {"backend": "hf", "batch_size": self.batch_size}


def sampling_logprobs_reference(
    model, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingConfig
) -> torch.Tensor:
    """Plain reference: fp32 log-probs ``(len(completion_ids),)`` of ``completion_ids`` under
    the sampling distribution, from one full forward over prompt + completion (no cache)."""
    model = _unwrap(model)
    device = next(model.parameters()).device
    full = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
    with torch.no_grad():
        logits = model(input_ids=full).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(process_logits(logits, sampling), dim=-1)
    return logp.gather(1, full[0, len(prompt_ids) :, None]).squeeze(1).cpu()
