"""What the app and the kit's trainer exchange, declared in one typed object instead of loose attributes.

:func:`channel` gives a trainer's :class:`TrainerChannel` (made on first use, so every mixin composed into the
trainer, and TRL's own class composed with the guards, share one):

* ``signals``: set by the app; a :class:`grpo_kit.trainer.checkpoints.SignalStop` whose SIGTERM / SIGINT makes the
  trainer save at the next logged step and stop;
* ``sync_log``: written by the generation hook, one entry per weight sync to the engine (``step``, ``mode``,
  ``seconds``, ...);
* ``generation_seconds``: wall seconds in the kit's generation (sync, generate, back to sleep), all calls;
* ``stop_error``: written by the guards and the signal stop; after ``train()`` returns, the
  :class:`grpo_kit.trainer.guards.TrainingStopped` the app raises, or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ATTR = "kit_channel"


@dataclass
class TrainerChannel:
    signals: object | None = None
    sync_log: list = field(default_factory=list)
    generation_seconds: float = 0.0
    stop_error: Exception | None = None


def channel(trainer) -> TrainerChannel:
    """``trainer``'s channel, made on first use."""
    found = trainer.__dict__.get(_ATTR)
    if found is None:
        found = trainer.__dict__[_ATTR] = TrainerChannel()
    return found
