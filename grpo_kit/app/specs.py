"""The one place where the app's config is turned into what each layer below it takes: a small frozen spec per
layer, of exactly the fields that layer reads, named as in the config.

* ``StepSpec`` (memory): the step the VRAM calculator prices;
* ``DataSpec`` (tasks): the task and its data;
* ``DeviceSpec`` (model): where and in which dtype the run trains;
* ``GenerationSpec`` (generation): sampling and the vLLM engine's options, with the step;
* ``TrainerSpec`` (trainer): the rewards' and tools' checks, the loss's chunks, the guards, with the step.

No module below the app reads the config (tests/test_house.py): renaming a config field fails here, where the
spec's field of that name is filled, and in the house test that holds every spec field to a config field. A
layer's public function may still be handed the config itself (notebooks do): it asks the config for its spec
(``GRPOKitConfig.spec``, which calls :func:`layer_spec`), reading none of its fields.
"""

from __future__ import annotations

import dataclasses

from grpo_kit.generation.spec import GenerationSpec
from grpo_kit.memory.spec import StepSpec
from grpo_kit.model.devices import DeviceSpec
from grpo_kit.tasks.data import DataSpec
from grpo_kit.trainer.spec import TrainerSpec

LAYER_SPECS = (StepSpec, DataSpec, DeviceSpec, GenerationSpec, TrainerSpec)
_BY_NAME = {kind.__name__: kind for kind in LAYER_SPECS}


def layer_spec(cfg, kind: type):
    """The spec ``kind`` (one of :data:`LAYER_SPECS`) of the config ``cfg``: each field the config's field of the
    same name, a field whose type is another spec (``step``) that spec of the same config."""
    if kind not in LAYER_SPECS:
        raise TypeError(f"{getattr(kind, '__name__', kind)!r} is no layer spec; the app builds {', '.join(_BY_NAME)}")
    values = {}
    for f in dataclasses.fields(kind):
        inner = _BY_NAME.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        values[f.name] = layer_spec(cfg, inner) if inner is not None else getattr(cfg, f.name)
    return kind(**values)
