"""A compact Llama/Qwen2 decoder written for batched decoding with ragged lengths.

Every sequence b in a batch has its own length `cache_lens[b]`. KV slots are indexed by
absolute position, so a query at position p attends to slots [0, p] of its own row; slots
beyond a row's length hold stale values that the mask never reads. Rolling a sequence back
(rejected draft tokens) is just lowering its length: the stale slots are overwritten later.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from drafter.model.config import ModelConfig
from drafter.model.linear import Linear


class KVCache:
    """Preallocated keys/values for all layers: (L, B, S, H_kv, D), one row per live sequence."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def keep_rows(self, rows: torch.Tensor, in_place: bool = False) -> None:
        """Drop finished sequences: keep only `rows` (a 1-D index tensor), in that order. in_place: as rows
        0..n-1 of the same tensors (a captured CUDA graph holds their address), the rest left as scratch."""
        if in_place:
            n = len(rows)
            self.k[:, :n] = self.k[:, rows]
            self.v[:, :n] = self.v[:, rows]
        else:
            self.k = self.k.index_select(1, rows)
            self.v = self.v.index_select(1, rows)
        self.lens = self.lens.index_select(0, rows)


def attention_mask(positions: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(B, T) absolute query positions -> (B, 1, T, S) bool, True where the slot is visible."""
    slots = torch.arange(num_slots, device=positions.device)
    return slots.view(1, 1, 1, -1) <= positions[:, None, :, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))  # None: the default device, as nn.Linear
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # bf16 activations under autocast: normalise in float32
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@functools.lru_cache(maxsize=8)
def rotary_tables(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), (P, D) float32, shared by every module with these settings and never written:
    computing them is most of the cost of building a draft head (16k positions for SmolLM2's)."""
    # device="cpu" explicitly: a first call may come from a head built under torch.device("meta"),
    # and the cached tables must be real
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64, device="cpu"), inv_freq)  # (P, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (P, D), HF "rotate_half" layout
    return angles.cos().float(), angles.sin().float()


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        cos, sin = rotary_tables(head_dim, max_position, float(theta))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # (B, T) -> (B, T, 1, D) to broadcast over heads in (B, T, H, D)
        return self.cos[positions].unsqueeze(2).to(dtype), self.sin[positions].unsqueeze(2).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=False)
        self.split = (q_dim, kv_dim, kv_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None,
                layer: int, positions: torch.Tensor, mask: torch.Tensor | None, num_slots: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rotary(q.view(B, T, self.num_heads, self.head_dim), *rope)  # (B, T, H, D)
        k = apply_rotary(k.view(B, T, self.num_kv_heads, self.head_dim), *rope)  # (B, T, Hkv, D)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if cache is None:  # training / scoring: attend within this forward only (autograd-friendly)
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, D)
        else:
            rows = torch.arange(B, device=x.device).unsqueeze(1)  # (B, 1) with positions (B, T)
            cache.k[layer][rows, positions] = k
            cache.v[layer][rows, positions] = v
            keys = cache.k[layer, :, :num_slots].transpose(1, 2)  # (B, Hkv, S, D)
            values = cache.v[layer, :, :num_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache, layer, positions, mask, num_slots):
        x = x + self.attn(self.input_norm(x), rope, cache, layer, positions, mask, num_slots)
        return x + self.mlp(self.post_attn_norm(x))


def attention_inputs(positions: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor | None, int]:
    """Mask and number of cache slots to read for a forward at `positions` (B, T). Without a cache
    the keys are this forward's own tokens: causal by position, (B, 1, T, T)."""
    if cache is None:
        return positions[:, None, None, :] <= positions[:, None, :, None], positions.shape[1]
    num_slots = int(positions.max()) + 1
    if num_slots > cache.max_len:
        raise ValueError(f"position {num_slots - 1} is beyond the KV cache ({cache.max_len} slots)")
    B, T = positions.shape
    if B == 1 and T == 1:
        return None, num_slots  # one query at the newest slot sees everything before it
    return attention_mask(positions, num_slots), num_slots


def tree_inputs(positions: torch.Tensor, cache: KVCache | None,
                tree: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(slots to write K/V at, mask, number of slots read): by position, or as a draft tree says."""
    if tree is None:
        return (positions, *attention_inputs(positions, cache))
    slots, mask = tree
    if cache is None:
        raise ValueError("a draft tree forward needs a KV cache")
    if mask.shape[-1] > cache.max_len:
        raise ValueError(f"slot {mask.shape[-1] - 1} is beyond the KV cache ({cache.max_len} slots)")
    return slots, mask, mask.shape[-1]


def draft_features(hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """The features the engine records per position for drafter training and hands an EAGLE-3 draft head:
    the aux layers' states (..., 3D), then the final-norm hidden state (..., D), concatenated (..., 4D). The
    head fuses the first 3D (drafter.draft.head.EagleHead.fuse); the last D is only a training target (the policy's
    next-token distribution there is its LM head over it)."""
    return torch.cat([aux, hidden], dim=-1)


class CausalLM(nn.Module):
    """Llama/Qwen2-family decoder. `forward` returns (logits, hidden) for the requested positions, and the
    hidden states of chosen layers (EAGLE-3's aux states) when asked."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_len: int, extra: int = 0) -> KVCache:
        """Room for max_len positions (at most the context) plus `extra` slots for a draft tree's
        siblings past the last position."""
        c = self.cfg
        return KVCache(c.num_layers, batch_size, min(max_len, c.max_position) + extra, c.num_kv_heads,
                       c.head_dim, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                logits_for: str = "all", tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                aux_layers: tuple[int, ...] | None = None) -> tuple:
        """input_ids, positions: (B, T). Writes K/V at `positions`; does not change cache.lens.
        cache=None: a self-contained causal forward (training, log-probabilities), differentiable.
        tree: (slots (B, T), mask (B, 1, T, S)) for a draft tree (drafter.decode.tree), whose siblings share
        a rotary position: K/V go to `slots` and attention follows `mask` instead of the positions.

        logits_for: "all" -> (B, T, V); "last" -> (B, 1, V); "none" -> None (prefill).
        Returns (logits, hidden): hidden the final-norm hidden states (B, T, D). With `aux_layers`
        (layer ids as vLLM numbers EAGLE-3's aux states: id i is the residual stream entering layer i, 0 the
        embeddings, num_layers the last layer's output before the final norm) it returns (logits, hidden, aux)
        too, aux (B, T, len(aux_layers) * D) their concatenation in the order given: what an EAGLE-3 head
        fuses. Keeping a reference per asked layer is all it costs; nothing is kept when not asked.
        """
        x = self.embed_tokens(input_ids)  # (B, T, D)
        rope = self.rotary(positions, x.dtype)
        slots, mask, num_slots = tree_inputs(positions, cache, tree)
        wanted = set(aux_layers) if aux_layers is not None else set()
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in wanted:
                kept[i] = x  # the layers never write x in place: a reference is a snapshot
            x = layer(x, rope, cache, i, slots, mask, num_slots)
        if len(self.layers) in wanted:
            kept[len(self.layers)] = x
        hidden = self.norm(x)
        if logits_for == "none":
            logits = None
        elif logits_for == "last":
            logits = self.lm_head(hidden[:, -1:])
        else:
            logits = self.lm_head(hidden)
        if aux_layers is None:
            return logits, hidden
        missing = sorted(wanted - set(kept))
        if missing:
            raise ValueError(f"aux_layers {missing} are not layers of this model (0..{len(self.layers)})")
        return logits, hidden, torch.cat([kept[i] for i in aux_layers], dim=-1)  # (B, T, n * D)
