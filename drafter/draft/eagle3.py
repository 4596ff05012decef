"""Draft heads as standard EAGLE-3 checkpoint directories (`LlamaForCausalLMEagle3`), the layout vLLM and
SGLang load for EAGLE-3 speculation, so every engine serves the drafts we train.

A directory holds `config.json` and `model.safetensors` (safetensors only: nothing is unpickled).
Tensors (D hidden size, I intermediate size, V the target's vocabulary, V' the draft's):
    fc.weight                                  [D, 3D]  fuses the three aux states
    midlayer.input_layernorm.weight            [D]      the token embedding's norm
    midlayer.hidden_norm.weight                [D]      the hidden's norm
    midlayer.self_attn.{q,k,v}_proj.weight     [heads * head_dim, 2D]  over [embedding; hidden]
    midlayer.self_attn.o_proj.weight           [D, heads * head_dim]
    midlayer.post_attention_layernorm.weight   [D]
    midlayer.mlp.{gate,up}_proj.weight         [I, D];  midlayer.mlp.down_proj.weight [D, I]
    norm.weight                                [D]
    lm_head.weight                             [V', D]
    d2t                                        [V'] int64: target id = draft id + d2t[draft id]
    t2d                                        [V] bool: which target tokens are in the draft vocabulary
d2t and t2d only when the draft vocabulary is smaller than the target's: vLLM's Eagle3LlamaForCausalLM has
no d2t parameter when the two are equal (draft_vocab_size == target vocab size) and refuses the name then.
No embed_tokens: both engines then share the target's embedding (vLLM skips the name when absent; the head
uses the policy's too). The aux layers are recorded twice, because the two engines number them apart:
- top-level `eagle_aux_hidden_state_layer_ids` (vLLM, vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
  get_eagle3_aux_layers_from_config): id i is the residual stream entering target layer i (vLLM's llama.py
  collects `hidden_states + residual` before layer i, or after layer i - 1); our head's numbering;
- `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's set_eagle3_layers_to_capture), which SGLang
  shifts by one (it captures before layer id + 1): written as our ids minus one, with
  `eagle_config.use_aux_hidden_state` true. An id 0 (the embeddings, tiny test models only) becomes -1 there,
  which SGLang does not capture.
Our own extras (draft temperature, seed) live under the "tlt" key, which the engines ignore.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from drafter.draft.head import EagleConfig, EagleHead, head_from_state
from drafter.model.causal_lm import CausalLM
from drafter.model.config import DRAFT_FORMAT, NUM_AUX_LAYERS, ModelConfig, check_aux_layer_ids, default_aux_layer_ids
from drafter.model.int8 import Int8Linear
from drafter.train.checkpoint import save_file_atomic

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
OPTIONAL_TENSORS = ("d2t", "t2d", "embed_tokens.weight")  # d2t absent: the identity map (vLLM's default)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _int(config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive int, got {value!r}")
    return value


def _dims(config: dict) -> dict[str, int]:
    """The shapes a config.json describes; ValueError naming the key that does not describe an EAGLE-3 head."""
    if not isinstance(config, dict):
        raise ValueError("config.json: not a JSON object")
    archs = config.get("architectures")
    if not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise ValueError(f"config.json: architectures must name {ARCHITECTURE}, got {archs!r}")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"config.json: num_hidden_layers must be 1 (one midlayer), "
                         f"got {config['num_hidden_layers']!r}")
    if config.get("tie_word_embeddings", False):
        raise ValueError("config.json: tie_word_embeddings must be false (the head has its own lm_head)")
    d = {key: _int(config, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "vocab_size")}
    d["head_dim"] = _int(config, "head_dim", d["hidden_size"] // d["num_attention_heads"])
    d["draft_vocab_size"] = _int(config, "draft_vocab_size", d["vocab_size"])
    d["target_hidden_size"] = _int(config, "target_hidden_size", d["hidden_size"])
    if d["draft_vocab_size"] > d["vocab_size"]:
        raise ValueError(f"config.json: draft_vocab_size {d['draft_vocab_size']} exceeds vocab_size {d['vocab_size']}")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) != NUM_AUX_LAYERS
                            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ValueError(f"config.json: eagle_aux_hidden_state_layer_ids must be {NUM_AUX_LAYERS} ids >= 0, "
                         f"got {ids!r}")
    return d


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the layout (optional ones included) and its shape under `config`."""
    d = _dims(config)
    H, inter, V, Vd = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["draft_vocab_size"]
    q, kv = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
    return {
        "fc.weight": (H, NUM_AUX_LAYERS * d["target_hidden_size"]),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "d2t": (Vd,),
        "t2d": (V,),
        "embed_tokens.weight": (V, H),
    }


def check_tensors(tensors: dict[str, torch.Tensor], config: dict) -> None:
    """ValueError naming the first tensor that is missing, unexpected, misshapen, of the wrong kind, or (d2t,
    t2d) not a valid map between the vocabularies."""
    shapes = expected_shapes(config)
    for name in shapes:
        if name not in tensors and name not in OPTIONAL_TENSORS:
            raise ValueError(f"tensor {name} is missing")
    for name, t in tensors.items():
        if name not in shapes:
            raise ValueError(f"tensor {name} is not part of the {ARCHITECTURE} layout")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
        if name == "t2d":
            if t.dtype != torch.bool:
                raise ValueError(f"tensor t2d must be bool, got {t.dtype}")
        elif name == "d2t":
            if t.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"tensor d2t must be int64, got {t.dtype}")
        elif t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name} must be float32, bfloat16 or float16, got {t.dtype}")
    target = target_ids(tensors, config)
    V = shapes["t2d"][0]
    if int(target.min()) < 0 or int(target.max()) >= V or target.unique().numel() != target.numel():
        raise ValueError(f"tensor d2t maps draft ids outside the target vocabulary [0, {V}) or twice to one id")
    if "t2d" in tensors:
        t2d = tensors["t2d"]
        if int(t2d.sum()) != target.numel() or not bool(t2d[target].all()):
            raise ValueError("tensor t2d does not mark exactly the target ids d2t maps to")


def target_ids(tensors: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """(V',) int64: the target id of every draft id (arange + d2t; the identity without d2t)."""
    n = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else _dims(config)["draft_vocab_size"]
    base = torch.arange(n, dtype=torch.long, device="cpu")  # checkpoint tensors are read on the CPU
    return base + tensors["d2t"].long().cpu() if "d2t" in tensors else base


def eagle3_tensors(head: EagleHead, copy: bool = True) -> dict[str, torch.Tensor]:
    """The head's weights under the standard names, on the CPU: what model.safetensors holds, and what an
    engine's in-place reload of the draft takes. Copies (the head may go on training), or with copy=False the
    head's own CPU weights wherever no split is needed (a head built for the export alone: a live swap's 39 MB
    SmolLM2 draft is then not copied twice). No d2t/t2d when the draft vocabulary is the whole target vocabulary
    (then always in order: set_vocab sorts the ids)."""
    if any(isinstance(m, Int8Linear) for m in head.modules()):
        raise ValueError("an int8 head has no float weights to export: export the float head it was made from")
    c = head.policy_cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = head.midlayer

    def w(t: torch.Tensor, split: bool = False) -> torch.Tensor:
        t = t.detach().to("cpu")
        return t.clone().contiguous() if copy or split else t.contiguous()  # parts of one tensor: safetensors
        # refuses tensors sharing memory

    q_w, k_w, v_w = (w(t, split=True) for t in layer.self_attn.qkv_proj.weight.split((q, kv, kv), dim=0))
    gate, up = (w(t, split=True) for t in layer.mlp.gate_up_proj.weight.chunk(2, dim=0))  # MLP.forward: gate, up
    ids = head.vocab_ids.detach().to("cpu").long()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device="cpu")  # the export is on the CPU, as the file
    t2d[ids] = True
    maps = {"d2t": ids - torch.arange(ids.numel(), dtype=torch.long, device="cpu"), "t2d": t2d}
    if ids.numel() == c.vocab_size:
        if bool(maps["d2t"].any()):
            raise ValueError("vocab_ids: a draft vocabulary of the whole target vocabulary must be in order")
        maps = {}
    return {
        "fc.weight": w(head.fc.weight),
        "midlayer.input_layernorm.weight": w(layer.input_layernorm.weight),
        "midlayer.hidden_norm.weight": w(layer.hidden_norm.weight),
        "midlayer.self_attn.q_proj.weight": q_w,
        "midlayer.self_attn.k_proj.weight": k_w,
        "midlayer.self_attn.v_proj.weight": v_w,
        "midlayer.self_attn.o_proj.weight": w(layer.self_attn.o_proj.weight),
        "midlayer.post_attention_layernorm.weight": w(layer.post_attention_layernorm.weight),
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": w(layer.mlp.down_proj.weight),
        "norm.weight": w(head.norm.weight),
        "lm_head.weight": w(head.lm_head.weight),
        **maps,
    }


def eagle3_config(head: EagleHead, policy: CausalLM | ModelConfig) -> dict:
    """config.json for `head` drafting for `policy` (a CausalLM, or its ModelConfig)."""
    c = head.policy_cfg
    target = policy.cfg if isinstance(policy, CausalLM) else policy
    if target.hidden_size != c.hidden_size or target.vocab_size != c.vocab_size:
        raise ValueError(f"the head was built for hidden size {c.hidden_size} and vocabulary {c.vocab_size}, the "
                         f"policy has {target.hidden_size} and {target.vocab_size}")
    ids = [int(i) for i in head.aux_layers]
    eos = list(target.eos_token_ids)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": int(head.vocab_ids.numel()),
        "target_hidden_size": target.hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": False,  # the residual stream starts from the un-normed hidden
        "bos_token_id": target.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": _DTYPE_NAMES.get(head.fc.weight.dtype, "float32"),
        "eagle_aux_hidden_state_layer_ids": ids,  # vLLM's numbering (module docstring)
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]},
        "tlt": {"format": DRAFT_FORMAT, "target_num_layers": target.num_layers,
                "draft_temperature": head.cfg.draft_temperature, "init_seed": head.cfg.init_seed},
    }


def write_eagle3_dir(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write config.json and model.safetensors into `out_dir` (created), each atomically; returns the
    directory. ValueError naming the tensor or key that does not fit the layout, before anything is written."""
    check_tensors(tensors, config)
    try:
        text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json: not serialisable as JSON ({exc})") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file_atomic(out / WEIGHTS_FILE, {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
                     {"format": "pt"})
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{CONFIG_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out / CONFIG_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def read_eagle3_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors on the CPU, config) of an EAGLE-3 directory, checked as write_eagle3_dir checks them;
    ValueError naming the file, key or tensor at fault."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}/{CONFIG_FILE}: unreadable ({exc})") from None
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"{path}: no {WEIGHTS_FILE}")
    _dims(config)  # a wrong architecture is named before the tensors are read
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{weights}: unreadable or truncated safetensors file ({exc})") from None
    check_tensors(tensors, config)
    return tensors, config


def export_eagle3(head: EagleHead, policy: CausalLM | ModelConfig, out_dir: str | Path) -> Path:
    """Write `head` as a LlamaForCausalLMEagle3 directory for `policy`; returns the directory."""
    return write_eagle3_dir(out_dir, eagle3_tensors(head), eagle3_config(head, policy))


def import_eagle3(path: str | Path, policy_cfg: ModelConfig) -> EagleHead:
    """The head an EAGLE-3 directory holds, for a policy with `policy_cfg` (its shapes must be the policy's:
    our midlayer is shaped like a policy layer). ValueError naming what does not load or fit."""
    tensors, config = read_eagle3_dir(path)
    if isinstance(policy_cfg, CausalLM):
        policy_cfg = policy_cfg.cfg
    d = _dims(config)
    ours = {"hidden_size": policy_cfg.hidden_size, "target_hidden_size": policy_cfg.hidden_size,
            "intermediate_size": policy_cfg.intermediate_size, "num_attention_heads": policy_cfg.num_heads,
            "num_key_value_heads": policy_cfg.num_kv_heads, "head_dim": policy_cfg.head_dim,
            "vocab_size": policy_cfg.vocab_size}
    for key, value in ours.items():
        if d[key] != value:
            raise ValueError(f"config.json: {key} is {d[key]}, the policy's is {value}")
    for key, value in (("rms_norm_eps", policy_cfg.rms_norm_eps), ("rope_theta", policy_cfg.rope_theta)):
        theirs = config.get(key, value)
        if not isinstance(theirs, (int, float)) or abs(float(theirs) - value) > 1e-9 * max(1.0, abs(value)):
            raise ValueError(f"config.json: {key} is {theirs!r}, the policy's is {value}")
    if "embed_tokens.weight" in tensors:
        raise ValueError("tensor embed_tokens.weight: the draft has its own token embedding; these heads use the "
                         "policy's")
    ids = config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(policy_cfg.num_layers)
    try:
        ids = check_aux_layer_ids(ids, policy_cfg.num_layers)
    except ValueError as exc:
        raise ValueError(f"config.json: eagle_aux_hidden_state_layer_ids: {exc}") from None
    extras = config.get("tlt") if isinstance(config.get("tlt"), dict) else {}
    num_draft = d["draft_vocab_size"]
    try:
        cfg = EagleConfig(aux_layer_ids=ids, draft_vocab_size=None if num_draft == policy_cfg.vocab_size else num_draft,
                          init_seed=int(extras.get("init_seed", 0)),
                          draft_temperature=float(extras.get("draft_temperature", 1.0)))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json: tlt: {exc}") from None
    dtype = tensors["fc.weight"].dtype
    f = {k: t.to(dtype) for k, t in tensors.items() if t.is_floating_point()}
    state = {
        "fc.weight": f["fc.weight"],
        "midlayer.input_layernorm.weight": f["midlayer.input_layernorm.weight"],
        "midlayer.hidden_norm.weight": f["midlayer.hidden_norm.weight"],
        "midlayer.self_attn.qkv_proj.weight": torch.cat([f[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv"]),
        "midlayer.self_attn.o_proj.weight": f["midlayer.self_attn.o_proj.weight"],
        "midlayer.post_attention_layernorm.weight": f["midlayer.post_attention_layernorm.weight"],
        "midlayer.mlp.gate_up_proj.weight": torch.cat([f["midlayer.mlp.gate_proj.weight"],
                                                       f["midlayer.mlp.up_proj.weight"]]),
        "midlayer.mlp.down_proj.weight": f["midlayer.mlp.down_proj.weight"],
        "norm.weight": f["norm.weight"],
        "lm_head.weight": f["lm_head.weight"],
        "vocab_ids": target_ids(tensors, config),
    }
    head = head_from_state({"format": DRAFT_FORMAT, "policy": policy_cfg.to_dict(), "eagle": cfg.to_dict()}, state)
    return head.eval()
