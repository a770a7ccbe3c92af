"""Trainer construction: TRL's stock ``GRPOTrainer``, selected by ``GRPOKitConfig.trainer``."""

from __future__ import annotations


def make_trainer(cfg, *, model, tokenizer, reward_funcs, args, train_dataset, callbacks=(), peft_config=None):
    """Build the trainer the config asks for, with TRL's constructor arguments."""
    from trl import GRPOTrainer

    tokenizer.padding_side = "left"  # TRL requires left padding for generation
    return GRPOTrainer(model=model, reward_funcs=list(reward_funcs), args=args, train_dataset=train_dataset,
                       processing_class=tokenizer, callbacks=list(callbacks), peft_config=peft_config)
