"""Loading: HF directories against transformers' own logits, save/load round trips, the GGUF cache, errors."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from drafter.model.causal_lm import CausalLM
from drafter.model.loading import (
    PRESETS,
    LoadedModel,
    config_from_hf,
    encode_prompt,
    load_gguf,
    load_hf_dir,
    load_model,
    save_hf_dir,
    sha256_file,
    smollm2_gguf_path,
)

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def hf_tiny(kind: str, tie: bool, seed: int = 0) -> torch.nn.Module:
    """A random transformers model with large, varied weights, so that any mapping mistake shows in the logits."""
    torch.manual_seed(seed)
    if kind == "llama":  # head_dim 24 != hidden/heads: q/k/v widths differ from hidden_size
        model = LlamaForCausalLM(LlamaConfig(**SMALL, head_dim=24, rope_theta=5000.0, tie_word_embeddings=tie))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, rope_theta=20000.0, tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model.eval()


def our_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    B, T = ids.shape
    with torch.no_grad():
        logits, _ = model(ids, torch.arange(T).expand(B, T), model.new_cache(B, T), logits_for="all")
    return logits  # (B, T, V)


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def token_batch(vocab_size: int, B: int = 3, T: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind, tie, shard", [("llama", True, False), ("llama", False, True), ("qwen2", False, False),
                                              ("qwen2", True, True)])
def test_hf_dir_matches_transformers(tmp_path: Path, kind: str, tie: bool, shard: bool) -> None:
    hf = hf_tiny(kind, tie)
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    loaded = load_hf_dir(tmp_path)
    cfg = loaded.model.cfg
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.attention_bias) == (kind, tie, kind == "qwen2")
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and loaded.tokenizer is None
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    ids = token_batch(cfg.vocab_size)
    expected = hf_logits(hf, ids)
    assert expected.std() > 0.5  # not near-uniform: a wrong mapping could not hide
    torch.testing.assert_close(our_logits(loaded.model, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_save_load_round_trip(tmp_path: Path, preset: str) -> None:
    model = load_model(preset, init_seed=3).model
    save_hf_dir(model, None, tmp_path)
    loaded = load_hf_dir(tmp_path)
    assert loaded.model.cfg == model.cfg
    assert loaded.model.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    if model.cfg.tie_word_embeddings:
        assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float32).eval()
    ids = token_batch(model.cfg.vocab_size, B=2, T=9)
    torch.testing.assert_close(hf_logits(hf, ids), our_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_presets_are_seeded_and_not_degenerate() -> None:
    a, b, c = (load_model("tiny", init_seed=s).model for s in (0, 0, 1))
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    for name in PRESETS:
        loaded = load_model(name, dtype=torch.bfloat16)
        assert loaded.name == name and loaded.tokenizer is None and loaded.model.dtype == torch.bfloat16
        logits = our_logits(loaded.model, token_batch(loaded.model.cfg.vocab_size)).float()
        assert logits.isfinite().all() and 0.3 < logits.std() < 10


def test_config_from_hf_layouts() -> None:
    v4 = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=None,
              eos_token_id=[5, 7], tie_word_embeddings=True)
    cfg = config_from_hf(v4)
    assert (cfg.head_dim, cfg.rope_theta, cfg.eos_token_ids, cfg.attention_bias) == (8, 500000.0, (5, 7), False)
    v5 = {**v4, "model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
          "head_dim": 32, "eos_token_id": 3}
    del v5["rope_theta"]
    cfg = config_from_hf(v5)
    assert (cfg.head_dim, cfg.rope_theta, cfg.eos_token_ids, cfg.attention_bias) == (32, 1e6, (3,), True)
    with pytest.raises(ValueError, match="rope scaling type 'llama3'"):
        config_from_hf({**v4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        config_from_hf({**v5, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        config_from_hf({**v4, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        config_from_hf({k: v for k, v in v4.items() if k != "num_hidden_layers"})


def test_bad_inputs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model spec 'no-such-model'.*preset.*\.gguf.*HF model directory"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="GGUF file not found"):
        load_model(str(tmp_path / "absent.gguf"))
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(str(tmp_path))
    save_hf_dir(load_model("tiny-qwen2").model, None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing: \[model\.layers\.1\.self_attn\.k_proj\.bias\].*"
                                         r"unexpected: \[model\.layers\.0\.extra\.weight\]"):
        load_hf_dir(tmp_path)
    del tensors["model.layers.0.extra.weight"]
    tensors["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(5)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="shapes do not match"):
        load_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer"):
        encode_prompt(None, "hi")


# ---- SmolLM2 GGUF ----------------------------------------------------------------------------------------------


class Spy:
    """Wraps a transformers `from_pretrained` to keep what it returns (so the suite dequantizes the GGUF once)."""

    def __init__(self, cls: type) -> None:
        self.original, self.results = cls.from_pretrained, []

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.results.append(self.original(*args, **kwargs))
        return self.results[-1]


def refuse(*args: object, **kwargs: object) -> None:
    raise RuntimeError("conversion attempted")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """(ours, transformers' GGUF-loaded model, its GGUF tokenizer). Honours TLT_CACHE_DIR (set by `make test`), so
    the conversion runs once per machine; without it, once per session into a temp dir."""
    try:
        path = smollm2_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("TLT_CACHE_DIR"):
            mp.setenv("TLT_CACHE_DIR", str(tmp_path_factory.mktemp("tlt-cache")))
        model_spy, tok_spy = Spy(AutoModelForCausalLM), Spy(AutoTokenizer)
        mp.setattr(AutoModelForCausalLM, "from_pretrained", model_spy)
        mp.setattr(AutoTokenizer, "from_pretrained", tok_spy)
        ours = load_model("smollm2-135m")
        gguf = {"gguf_file": path.name, "local_files_only": True}
        reference = model_spy.results[0] if model_spy.results else model_spy.original(
            path.parent, dtype=torch.float32, **gguf)
        # the first tokenizer call is the conversion's GGUF tokenizer; later ones read the cached directory
        tokenizer = tok_spy.results[0] if model_spy.results else tok_spy.original(path.parent, **gguf)
        yield ours, reference.eval(), tokenizer, Path(os.environ["TLT_CACHE_DIR"])


def test_smollm2_gguf_matches_transformers(smollm2) -> None:
    ours, reference, gguf_tokenizer, _ = smollm2
    assert isinstance(ours, LoadedModel) and ours.name == "smollm2-135m"
    ids = encode_prompt(ours.tokenizer, "What is the capital of France?")
    assert ids == encode_prompt(gguf_tokenizer, "What is the capital of France?")
    assert ids[0] == ours.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-4:] == ours.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert encode_prompt(ours.tokenizer, "hi there", chat=False) == ours.tokenizer.encode("hi there")
    im_end = ours.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2 and im_end in ours.model.cfg.eos_token_ids
    x = torch.tensor([ids])
    logits = our_logits(ours.model, x)
    torch.testing.assert_close(logits, hf_logits(reference, x), atol=1e-3, rtol=1e-3)
    assert ours.tokenizer.decode(int(logits[0, -1].argmax())) == "The"  # "The capital of France is Paris."


def test_smollm2_second_load_uses_cache(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, _, _, cache_root = smollm2
    monkeypatch.setenv("TLT_CACHE_DIR", str(cache_root))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)  # any conversion would fail
    start = time.perf_counter()
    again = load_model("smollm2-135m")
    assert time.perf_counter() - start < 10  # a conversion takes ~20 s; a cached load ~2 s
    for name, tensor in ours.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name
    digest = sha256_file(smollm2_gguf_path())
    source = json.loads((cache_root / "models" / digest[:16] / "source.json").read_text())
    assert source["gguf_sha256"] == digest


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        path = smollm2_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(RuntimeError, match="conversion attempted"):
        load_gguf(path, cache_dir=tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []  # neither a half cache nor a leftover temp dir
