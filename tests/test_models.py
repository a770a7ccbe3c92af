import pytest
import torch

from grpo_kit.model import loading as models


def test_embedded_roundtrip_gives_same_logits(tmp_path, monkeypatch):
    """GGUF -> cached HF folder -> reload: the same logits as the GGUF-loaded model."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("GRPO_KIT_CACHE", str(tmp_path))
    # an incomplete folder (tokenizer files only, as a tokenizer-only cache leaves) is moved aside, then exported
    # (one export: each reads the whole GGUF)
    stale = tmp_path / models.EMBEDDED_NAME
    stale.mkdir()
    (stale / "tokenizer_config.json").write_text("{}")
    path = models.embedded_model_dir()
    assert path == stale and path.parent == tmp_path
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").read_text() != "{}"
    kept = list(tmp_path.glob(f"{path.name}.incomplete-*"))
    assert kept and (kept[0] / "tokenizer_config.json").read_text() == "{}", "the incomplete folder is kept aside"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert models.embedded_model_dir() == path  # second call uses the cache
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp

    gguf = models._gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tok = models.load_model("smollm2-135m-instruct")
    model.eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.requires_grad for p in model.parameters())  # dequantised: plain trainable weights
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in text  # chat template survived the export
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_tiny_model_takes_the_tokenizer_without_exporting_the_embedded_weights(tmp_path, monkeypatch):
    """On a fresh cache a tiny model's tokenizer is the embedded one, cached alone (no weights' export); it renders
    and tokenizes as the full export's does, and the second call reads the cache."""
    monkeypatch.setenv("GRPO_KIT_CACHE", str(tmp_path))
    tok = models.load_tokenizer("tiny-llama")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{models.EMBEDDED_NAME}-tokenizer"]
    gguf = models._gguf_path()
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
    assert tok("Answer: 408")["input_ids"] == ref("Answer: 408")["input_ids"]
    stamp = (tmp_path / f"{models.EMBEDDED_NAME}-tokenizer" / "tokenizer_config.json").stat().st_mtime_ns
    models.load_tokenizer("tiny-qwen2")
    assert (tmp_path / f"{models.EMBEDDED_NAME}-tokenizer" / "tokenizer_config.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("name,model_type", [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")])
def test_tiny_models_are_the_real_architectures(name, model_type):
    model, tok = models.load_model(name)
    assert model.config.model_type == model_type
    ids = tok("hello world", return_tensors="pt").input_ids
    out = model(ids).logits
    assert out.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(out).all()
    if name == "tiny-qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's QKV bias


@pytest.mark.parametrize(
    "name,params_b",
    [
        ("llama-3.1-8b", 8.03),
        ("qwen2.5-1.5b", 1.54),
        ("qwen2.5-7b", 7.62),
        ("llama-3.2-1b", 1.24),
        ("mistral-7b", 7.25),
    ],
)
def test_config_only_architectures_have_published_sizes(name, params_b):
    model = models.build_random_model(name, dtype=torch.bfloat16, device="meta")
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(n - params_b) < 0.01, n


def test_check_model_name_errors_list_known_models():
    with pytest.raises(ValueError, match="tiny-llama"):
        models.check_model_name("not-a-model")
    assert models.check_model_name("Qwen/Qwen2.5-1.5B-Instruct") == "hub"
    assert models.check_model_name("tiny-qwen2") == "tiny"
