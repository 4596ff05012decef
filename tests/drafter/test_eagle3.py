"""Drafts in the standard EAGLE-3 layout (drafter/draft/eagle3.py): export and import round trips, the config keys
vLLM and SGLang read, an independent forward over the exported tensors as those engines compute it, the aux
layers' numbering, and bad directories refused with a ValueError naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.eagle import EagleDrafter
from drafter.draft.eagle3 import (
    ARCHITECTURE,
    eagle3_tensors,
    export_eagle3,
    import_eagle3,
    read_eagle3_dir,
    write_eagle3_dir,
)
from drafter.draft.head import EagleHead, new_head
from drafter.model.causal_lm import draft_features
from drafter.model.config import check_aux_layer_ids, default_aux_layer_ids
from drafter.model.int8 import int8_linear_available, quantize_int8
from tests.conftest import random_prompts, tiny_model

STANDARD_NAMES = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def perturbed_head(model, draft_vocab_size: int | None = 40, seed: int = 3) -> EagleHead:
    """A head whose every weight (norms included) differs from its neighbours', so a swapped or misplaced
    tensor shows; its draft vocabulary is not a prefix of the policy's, so d2t is not all zeros."""
    head = new_head(model, None, draft_vocab_size, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * (0.3 if p.dim() == 1 else 0.05))
        if draft_vocab_size is not None:
            head.vocab_ids.copy_(torch.randperm(model.cfg.vocab_size, generator=g)[:draft_vocab_size].sort().values)
            head.init_lm_head(model)
    return head.eval()


def test_export_import_round_trip_gives_identical_weights_and_drafts(tmp_path):
    model = tiny_model(seed=1)
    head = perturbed_head(model)
    out = export_eagle3(head, model, tmp_path / "draft")
    assert out == tmp_path / "draft" and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    back = import_eagle3(out, model.cfg)
    ours, theirs = head.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name
    assert back.aux_layers == head.aux_layers and back.cfg == head.cfg
    # the same drafts, greedy (output = plain decoding) and sampled (the same per-request seeds)
    engine = Engine(model)
    prompts = random_prompts([5, 9, 3], model.cfg.vocab_size, seed=4)
    for params in (SamplingParams(max_new_tokens=24), SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)):
        reqs = [Request(p, params) for p in prompts]
        a = engine.generate(reqs, k=3, drafter=EagleDrafter(model, head))
        b = engine.generate(reqs, k=3, drafter=EagleDrafter(model, back))
        assert [(o.token_ids, o.num_accepted, o.num_draft_tokens) for o in a] == \
               [(o.token_ids, o.num_accepted, o.num_draft_tokens) for o in b]
    plain = engine.generate([Request(p, SamplingParams(max_new_tokens=24)) for p in prompts])
    assert [o.token_ids for o in plain] == [o.token_ids for o in engine.generate(
        [Request(p, SamplingParams(max_new_tokens=24)) for p in prompts], k=4, drafter=EagleDrafter(model, back))]
    # bf16 weights stay bf16, and the config says so
    half = export_eagle3(head.to(torch.bfloat16), model, tmp_path / "half")
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert import_eagle3(half, model.cfg).fc.weight.dtype == torch.bfloat16


def test_the_directory_has_the_names_and_config_keys_vllm_and_sglang_read(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(seed=1, eos=(3,))
    head = perturbed_head(model)
    out = export_eagle3(head, model, tmp_path / "d")
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == STANDARD_NAMES  # no embed_tokens: the engines share the target's
    D, V = model.cfg.hidden_size, model.cfg.vocab_size
    assert tensors["fc.weight"].shape == (D, 3 * D) and tensors["lm_head.weight"].shape == (40, D)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (model.cfg.num_heads * model.cfg.head_dim, 2 * D)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,)
    assert torch.equal(torch.arange(40) + tensors["d2t"], head.vocab_ids)  # target id = draft id + d2t
    assert torch.equal(tensors["t2d"].nonzero().squeeze(1), head.vocab_ids)
    assert torch.equal(tensors["lm_head.weight"], model.lm_head.weight[head.vocab_ids])  # new_head: the policy's rows
    raw = json.loads((out / "config.json").read_text())
    ids = list(head.aux_layers)
    assert raw["architectures"] == [ARCHITECTURE] and raw["num_hidden_layers"] == 1
    assert raw["eagle_aux_hidden_state_layer_ids"] == ids  # top level: where vLLM reads it
    assert raw["eagle_config"] == {"use_aux_hidden_state": True,  # SGLang adds one to the ids it reads here
                                   "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}
    # parsed as the engines parse it: transformers' config, the keys as attributes
    cfg = transformers.AutoConfig.from_pretrained(str(out))
    assert type(cfg).__name__ == "LlamaConfig"
    assert list(cfg.eagle_aux_hidden_state_layer_ids) == ids and cfg.draft_vocab_size == 40
    assert cfg.target_hidden_size == D and cfg.hidden_size == D and cfg.vocab_size == V
    assert cfg.tie_word_embeddings is False and cfg.head_dim == model.cfg.head_dim
    assert cfg.num_key_value_heads == model.cfg.num_kv_heads and cfg.eos_token_id == 3
    # a draft vocabulary of the whole target vocabulary has no d2t/t2d: vLLM has no d2t parameter then
    full = eagle3_tensors(perturbed_head(model, draft_vocab_size=None))
    assert set(full) == STANDARD_NAMES - {"d2t", "t2d"} and full["lm_head.weight"].shape == (V, D)


def reference_eagle3(t: dict[str, torch.Tensor], cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 draft forward as vLLM's and SGLang's llama_eagle3 compute it, written from the standard
    tensors alone (one sequence, causal, no cache): (logits over the TARGET vocabulary, -inf outside the draft
    vocabulary, placed by d2t; the output before the final norm, which the next draft position takes)."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x):  # neox style (rotate halves), as vLLM's Llama uses
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = positions[:, None].double() * inv[None]  # (T, hd/2)
        cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    T = embeds.shape[0]
    residual = hidden  # norm_before_residual false: the residual stream starts from the un-normed hidden
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]),
                   rms(hidden, t["midlayer.hidden_norm.weight"])], -1)  # (T, 2D): [embedding; hidden]
    q = rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(T, nh, hd))
    k = rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, hd))
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * hd)
    attn = attn @ t["midlayer.self_attn.o_proj.weight"].T
    residual = attn + residual  # post_attention_layernorm(hidden, residual): the fused add, then the norm
    h = rms(residual, t["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(h @ t["midlayer.mlp.gate_proj.weight"].T) * (h @ t["midlayer.mlp.up_proj.weight"].T)) \
        @ t["midlayer.mlp.down_proj.weight"].T
    prenorm = mlp + residual  # norm(hidden, residual) returns (normed, prenorm)
    draft_logits = rms(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T  # (T, V')
    full = torch.full((T, cfg["vocab_size"]), float("-inf"))
    full[:, torch.arange(cfg["draft_vocab_size"]) + t["d2t"]] = draft_logits
    return full, prenorm


@torch.no_grad()
def test_an_independent_eagle3_forward_over_the_exported_tensors_matches_the_head(tmp_path):
    """Fusing the aux states, the first draft position and one fed-back position: the head and a forward
    written from the standard tensors as vLLM/SGLang compute it give the same logits on the target vocabulary."""
    model = tiny_model(seed=2)
    head = perturbed_head(model, draft_vocab_size=48)
    tensors, cfg = read_eagle3_dir(export_eagle3(head, model, tmp_path / "d"))
    seq = torch.tensor([random_prompts([9], model.cfg.vocab_size, seed=3)[0]])
    L = seq.shape[1]
    _, hidden, aux = model(seq, torch.arange(L)[None], None, aux_layers=tuple(cfg["eagle_aux_hidden_state_layer_ids"]))
    # the engines: fc over cat(aux states) at the target's positions, tokens shifted by one
    fused = aux[0, :-1] @ tensors["fc.weight"].T  # (L-1, D)
    embeds, positions = model.embed_tokens(seq[0, 1:]), torch.arange(L - 1)
    ref_logits, ref_prenorm = reference_eagle3(tensors, cfg, embeds, fused, positions)
    cache = head.new_cache(1, 2 * L, torch.float32, "cpu")
    out = head(head.fuse(draft_features(hidden, aux)[:, :-1]), embeds[None], positions[None], cache)  # (1, L-1, D)
    ours = torch.full((L - 1, model.cfg.vocab_size), float("-inf"))
    ours[:, head.vocab_ids] = head.logits(out)[0]
    torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0], ref_prenorm, atol=1e-4, rtol=1e-4)
    # the next draft position takes the output before the final norm (not fc'd again) and the drafted token
    x = int(ref_logits[-1].argmax())
    cache.lens[:] = L - 1
    nxt = head(out[:, -1:], model.embed_tokens(torch.tensor([[x]])), torch.tensor([[L - 1]]), cache)
    ref2, _ = reference_eagle3(tensors, cfg, torch.cat([embeds, model.embed_tokens(torch.tensor([x]))]),
                               torch.cat([fused, ref_prenorm[-1:]]), torch.arange(L))
    torch.testing.assert_close(head.logits(nxt)[0, 0], ref2[-1, head.vocab_ids], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_aux_layer_ids_number_the_residual_stream_as_vllm_and_hf_hidden_states_do(tmp_path):
    """Aux id i is the residual stream entering layer i: 0 the embeddings, L the last layer's output before the
    final norm; for i < L that is transformers' output_hidden_states[i] of the same weights."""
    model = tiny_model(seed=4)
    L = model.cfg.num_layers
    seq = torch.tensor([random_prompts([7], model.cfg.vocab_size, seed=1)[0]])
    pos = torch.arange(seq.shape[1])[None]
    logits, hidden, aux = model(seq, pos, None, aux_layers=(0, 1, L))
    plain_logits, plain_hidden = model(seq, pos, None)
    assert torch.equal(logits, plain_logits) and torch.equal(hidden, plain_hidden)  # asking changes nothing else
    D = model.cfg.hidden_size
    assert aux.shape == (1, seq.shape[1], 3 * D)
    torch.testing.assert_close(aux[..., :D], model.embed_tokens(seq))
    torch.testing.assert_close(model.norm(aux[..., 2 * D :]), hidden)
    with pytest.raises(ValueError, match="aux_layers"):
        model(seq, pos, None, aux_layers=(0, 1, L + 1))
    transformers = pytest.importorskip("transformers")
    from drafter.model.loading import save_hf_dir

    save_hf_dir(model, None, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    states = hf(seq, output_hidden_states=True).hidden_states  # (L + 1) tensors, the last one after the norm
    torch.testing.assert_close(aux[..., D : 2 * D], states[1], atol=1e-4, rtol=1e-4)
    # defaults: vLLM's own (2, L // 2, L - 3) where it names three layers; distinct ids for the tiny models
    assert default_aux_layer_ids(30) == (2, 15, 27) and default_aux_layer_ids(2) == (0, 1, 2)
    assert all(len(set(default_aux_layer_ids(n))) == 3 for n in range(2, 40))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        check_aux_layer_ids((2, 1, 0), 4)


@pytest.fixture
def good_dir(tmp_path) -> Path:
    model = tiny_model(seed=1)
    return export_eagle3(perturbed_head(model), model, tmp_path / "good")


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, drop: str | None = None, **replace) -> None:
    t = load_file(str(path / "model.safetensors"))
    if drop:
        del t[drop]
    t.update(replace)
    save_file(t, str(path / "model.safetensors"))


@pytest.mark.parametrize("breakage, message", [
    (lambda p: edit_tensors(p, drop="midlayer.hidden_norm.weight"), "tensor midlayer.hidden_norm.weight is missing"),
    (lambda p: edit_tensors(p, **{"fc.weight": torch.zeros(64, 128)}), r"tensor fc.weight has shape \(64, 128\)"),
    (lambda p: edit_tensors(p, **{"layers.0.mlp.down_proj.weight": torch.zeros(2)}),
     "tensor layers.0.mlp.down_proj.weight is not part of"),
    (lambda p: edit_tensors(p, d2t=torch.full((40,), 100, dtype=torch.long)), "tensor d2t maps draft ids outside"),
    (lambda p: edit_tensors(p, t2d=torch.zeros(64, dtype=torch.bool)), "tensor t2d does not mark"),
    (lambda p: edit_tensors(p, **{"norm.weight": torch.ones(64, dtype=torch.int32)}), "tensor norm.weight must be"),
    (lambda p: edit_config(p, architectures=["LlamaForCausalLM"]), "architectures must name LlamaForCausalLMEagle3"),
    (lambda p: edit_config(p, num_hidden_layers=2), "num_hidden_layers must be 1"),
    (lambda p: edit_config(p, draft_vocab_size=41), r"has shape \(40.*expected \(41"),
    (lambda p: edit_config(p, eagle_aux_hidden_state_layer_ids=[1, 2]), "eagle_aux_hidden_state_layer_ids must be"),
    (lambda p: edit_config(p, hidden_size="64"), "hidden_size must be a positive int"),
    (lambda p: (p / "config.json").unlink(), "no config.json"),
    (lambda p: (p / "config.json").write_text("{not json"), "config.json: unreadable"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 16), "model.safetensors: unreadable"),
])
def test_a_bad_directory_is_refused_naming_the_problem(good_dir, breakage, message):
    breakage(good_dir)
    with pytest.raises(ValueError, match=message):
        read_eagle3_dir(good_dir)
    with pytest.raises(ValueError, match=message):
        import_eagle3(good_dir, tiny_model().cfg)


def test_import_checks_the_policy_and_write_checks_before_writing(good_dir, tmp_path):
    model = tiny_model(seed=1)
    bigger = tiny_model(vocab_size=96).cfg
    with pytest.raises(ValueError, match="config.json: vocab_size is 64, the policy's is 96"):
        import_eagle3(good_dir, bigger)
    edit_config(good_dir, eagle_aux_hidden_state_layer_ids=[0, 1, 5])
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids.*in \\[0, 2\\]"):
        import_eagle3(good_dir, model.cfg)
    tensors, config = eagle3_tensors(perturbed_head(model)), json.loads((good_dir / "config.json").read_text())
    tensors["embed_tokens.weight"] = model.embed_tokens.weight.clone()  # allowed in the layout, not by our heads
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    out = write_eagle3_dir(tmp_path / "own_embed", tensors, config)
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        import_eagle3(out, model.cfg)
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match="tensor lm_head.weight is missing"):
        write_eagle3_dir(tmp_path / "never", tensors, config)
    assert not (tmp_path / "never").exists()
    if int8_linear_available():
        with pytest.raises(ValueError, match="int8 head"):
            eagle3_tensors(quantize_int8(perturbed_head(model)))
    with pytest.raises(ValueError, match="not a directory"):
        read_eagle3_dir(tmp_path / "absent")


def test_the_engine_serves_an_imported_head_losslessly_and_trains_it(tmp_path, device):
    """A directory written by another EAGLE-3 trainer (here: our export of a head, default aux ids absent from
    its config, as vLLM then falls back to) loads, serves greedy output equal to plain decoding, and trains, on
    the policy's device (the directory is read on the CPU)."""
    from drafter.model.config import TrainConfig
    from drafter.train.buffer import RolloutBuffer
    from drafter.train.trainer import DraftTrainer
    from drafter.train.warmstart import HarvestConfig, harvest

    model = tiny_model(seed=6).to(device)
    out = export_eagle3(perturbed_head(model, draft_vocab_size=None), model, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"], cfg["tlt"]
    (out / "config.json").write_text(json.dumps(cfg))
    head = import_eagle3(out, model.cfg)
    assert head.aux_layers == default_aux_layer_ids(model.cfg.num_layers) and head.cfg.draft_vocab_size is None
    engine = Engine(model)
    reqs = [Request(p, SamplingParams(max_new_tokens=32)) for p in random_prompts([4, 6, 9, 2], 64, seed=8)]
    plain = engine.generate(reqs)
    assert [o.token_ids for o in engine.generate(reqs, k=3, drafter=EagleDrafter(model, head))] == \
           [o.token_ids for o in plain]
    buffer = RolloutBuffer(max_bytes=16 << 20, hidden_dtype=torch.float32)
    harvest(engine, random_prompts([5] * 16, 64, seed=9), buffer, cfg=HarvestConfig(batch_size=16, max_new_tokens=24))
    assert buffer.hidden_size == 4 * model.cfg.hidden_size  # three aux states and the final hidden state
    head = head.to(device).requires_grad_(True)
    trainer = DraftTrainer(model, head, TrainConfig(warmup_steps=1, anneal_to_budget=False, bf16_autocast=False))
    batch = trainer.next_batch(buffer)
    losses = [trainer.micro_step(batch)["loss"] for _ in range(30)]
    assert losses[-1] < losses[15] < 0.9 * losses[0] and losses[-1] < 0.75 * losses[0], losses
