"""The policy's GPU-grade decode path: a static KV cache, batch sizes padded to buckets, no host
synchronization inside a forward, and each (batch bucket, tokens, slot bucket) forward captured once in a
CUDA graph and replayed (in the manner of nano-vllm's `capture_cudagraph` and gpt-fast's static KVCache).

It runs the same CausalLM weights as the eager path (drafter.model.causal_lm) through a leaner layer: one rotary
for q, k and v at once (v's tables are cos=1, sin=0), one cache write per layer, the residual adds fused
into the output projections (in-place addmm_), 18 top-level ops per layer at one token. Outputs equal the eager
path's up to float rounding (greedy tokens identical: tests/drafter/test_static.py).

Cache layout: (L, B, 2*Hkv, 1, S, D), keys then values: each KV head stored once. SDPA's fused CUDA kernels
take an attention mask only without enable_gqa (with it they fall back to the unfused math path), so the
G = H / Hkv query heads of a group are folded into the query length instead (q (B, Hkv, G*T, D) against the
group's one K/V head, the mask repeated per group: `fold_groups`), as flash-decoding does. A CPU's flash kernel
takes enable_gqa under a mask, but folded is faster there too (FOLD_GROUPS).

Rows 0..B-1 of the cache are the live sequences, in the engine's order; rows past them are scratch that
padded rows of a bucket write into. Graph outputs live in shared buffers valid until the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter.decode.capture import capture
from drafter.decode.projections import decode_product_forms, decode_row_block, project, project_into
from drafter.model.causal_lm import CausalLM, draft_features
from drafter.model.config import ModelConfig
from drafter.model.linear import PackedWeight, onednn_serves

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # past 128: multiples of 64
MIN_SLOTS = 64  # slot buckets are powers of two from here (a multiple of 16: SDPA's mask alignment)
MAX_GRAPH_TOKENS = 16  # forwards of more tokens per row (a verify of k > 15) run uncaptured, as prefills do
# fold each KV group's query heads into the query length on every device (attend). On a CPU (AMD EPYC, one
# thread, torch 2.13; SmolLM2's 9 heads over 3 KV heads, 4 rows, 512 slots) SDPA with enable_gqa took 241 us
# at 1 query token and 632 us at 5 in float32, folded 223 and 445; in bfloat16 2,004 and 834 us, folded 283 and
# 500: the CPU's flash kernel splits work by query rows, which one token per head leaves too few of
FOLD_GROUPS = True


@dataclass
class ShapeCounts:
    """What a static path did that a steady decode should not: graphs captured and caches, buffers or graph
    sets made anew (a first meeting of a shape does both; a second generate with the same sizes, neither),
    and blocking device-to-host reads (the decode loop's one per step)."""

    num_captures: int = 0
    num_rebuilds: int = 0
    num_host_reads: int = 0

    def total(self) -> int:
        """Captures and rebuilds: unchanged over a step means the step ran on shapes met before."""
        return self.num_captures + self.num_rebuilds


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host: on CUDA through pinned memory, asynchronously (a copy
    from pageable memory synchronizes the stream: it would wait for the step's queued kernels)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def batch_bucket(n: int) -> int:
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return -(-n // 64) * 64


def slot_bucket(n: int, max_len: int) -> int:
    s = MIN_SLOTS
    while s < n:
        s *= 2
    return min(s, max_len)


def slot_buckets(max_len: int) -> list[int]:
    """Every slot bucket up to max_len, smallest first."""
    out = [slot_bucket(1, max_len)]
    while out[-1] < max_len:
        out.append(slot_bucket(out[-1] + 1, max_len))
    return out


def rotate_half_matrix(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """P (D, D) with x @ P == cat(-x[D/2:], x[:D/2]) (HF's rotate_half): a signed permutation, exact in
    any dtype."""
    half = head_dim // 2
    P = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    idx = torch.arange(half, device=device)
    P[idx + half, idx] = -1.0  # out[j] = -x[j + D/2] for j < D/2
    P[idx, idx + half] = 1.0  # out[j] = x[j - D/2] for j >= D/2
    return P


def rope_tables(rotary, positions: torch.Tensor, is_rotated: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (B, T, NH, 1, D) at `positions` (B, T) for every q/k/v head (is_rotated (1, 1, NH, 1, 1):
    False for v heads, which get cos 1 and sin 0 and so pass the rotary unchanged)."""
    B, T = positions.shape
    cos = rotary.cos[positions].to(dtype).view(B, T, 1, 1, -1)
    sin = rotary.sin[positions].to(dtype).view(B, T, 1, 1, -1)
    return torch.where(is_rotated, cos, 1.0), torch.where(is_rotated, sin, 0.0)


def additive_mask(slot_ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, S) 0 where slot <= the query's position, -inf elsewhere: SDPA's fused kernels take it as
    is (a bool mask would be converted in every layer)."""
    B, T = positions.shape
    visible = slot_ids.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)
    return torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))


def rotated_heads(num_heads: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """(1, 1, NH, 1, 1) bool over the q, k, v heads of a fused projection: True for q and k."""
    total = num_heads + 2 * num_kv_heads
    return (torch.arange(total, device=device) < num_heads + num_kv_heads).view(1, 1, total, 1, 1)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, 1, T, S) -> (B, 1, G*T, S): the mask of each query row repeated for the G heads folded into it."""
    B, _, T, S = mask.shape
    return mask.unsqueeze(2).expand(B, 1, groups, T, S).reshape(B, 1, groups * T, S)


def attend(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotate: torch.Tensor, cache_l: torch.Tensor,
           keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
           mask: torch.Tensor, heads: tuple[int, int, int], fold_groups: bool | None = None) -> torch.Tensor:
    """One attention over a static cache layer: qkv (B*T, NH*D) fused projections -> (B*T, H*D). Rotary on
    q and k (v passes through), K/V written at `positions`, SDPA over `keys`/`values` (views of cache_l, one
    head per KV group). fold_groups: fold each group's query heads into the query length (None: FOLD_GROUPS);
    `mask` may come folded already (B, 1, G*T, S), else it is folded here."""
    H, Hkv, D = heads
    B, T = positions.shape
    cos, sin = rope
    qkv = qkv.view(B, T, H + 2 * Hkv, 1, D)
    qkv = torch.addcmul(qkv * cos, qkv @ rotate, sin)  # x cos + rotate_half(x) sin
    q, kv = qkv.split((H, 2 * Hkv), dim=2)  # (B, T, H, 1, D), (B, T, 2Hkv, 1, D)
    torch.ops.aten.index_put_(cache_l, [rows, None, None, positions], kv)  # one write per layer: (B, T, 2Hkv, 1, D)
    G = H // keys.shape[1]
    if G > 1 and (FOLD_GROUPS if fold_groups is None else fold_groups):
        # query head h = j*G + g reads KV head j: (B, H, T, D) -> (B, Hkv, G*T, D), one fused kernel with a mask
        mask = mask if mask.shape[2] == G * T else fold_mask(mask, G)
        if T == 1:  # as many ops as unfolded: the views differ only in shape
            out = F.scaled_dot_product_attention(q.view(B, H // G, G, D), keys, values, attn_mask=mask)
            return out.reshape(B, H * D)  # a GPU kernel may leave the heads strided: reshape copies only then
        q = q.squeeze(3).transpose(1, 2).reshape(B, H // G, G * T, D)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).reshape(B, H, T, D)
    else:
        q = q.view(B, H, 1, D) if T == 1 else q.squeeze(3).transpose(1, 2)  # (B, H, T, D)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=G > 1)  # (B, H, T, D)
    return out.view(B, H * D) if T == 1 else out.transpose(1, 2).reshape(B * T, H * D)


@dataclass
class LayerWeights:
    """One decoder layer's tensors as the static forward reads them (views of the module's parameters:
    in-place updates show through; a replaced parameter is caught by StaticRunner.check_weights)."""

    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # (hidden, H*D)
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor  # (hidden, I)
    o_t: torch.Tensor  # o and down transposed, for addmm (views made once)
    down_t: torch.Tensor
    packed: tuple[PackedWeight, PackedWeight, PackedWeight, PackedWeight]  # qkv, o, gate_up, down: the modules'


class StaticCache:
    """A static path's KV cache (the policy's, or a draft head's with one layer), with what the engine asks of
    a cache: per-row lengths, the slot capacity, and dropping finished rows (in place: captured graphs hold
    its address)."""

    def __init__(self, cfg: ModelConfig, num_layers: int, max_batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        # each KV head once (attend folds a group's query heads into the query length)
        self.kv = torch.zeros(num_layers, max_batch, 2 * cfg.num_kv_heads, 1, max_len, cfg.head_dim,
                              dtype=dtype, device=device)  # (L, B, 2Hkv, 1, S, D)
        self.lens = torch.zeros(0, dtype=torch.long, device=device)
        self.num_kv_heads = cfg.num_kv_heads
        self.num_used = 0  # slots per row written so far (host-side bound; compaction copies only these)

    @property
    def max_batch(self) -> int:
        return self.kv.shape[1]

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def keep_rows(self, rows: torch.Tensor, in_place: bool = True) -> None:
        """Keep only `rows` of the live batch, in that order, as rows 0..len(rows)-1 (always in place)."""
        n, used = len(rows), max(self.num_used, 1)
        self.kv[:, :n, :, :, :used] = self.kv[:, rows, :, :, :used]
        self.lens = self.lens.index_select(0, rows)

    def layer_views(self, num_rows: int, num_slots: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer: (the layer's cache to write (B_max, 2Hkv, 1, S_max, D), keys (B, Hkv, S, D), values
        (B, Hkv, S, D)) over the first num_rows rows and num_slots slots: views, made once per shape."""
        h = self.num_kv_heads
        out = []
        for layer in self.kv.unbind(0):  # (B, 2Hkv, G, S, D)
            B, _, G, _, D = layer.shape
            k = layer[:num_rows, :h].reshape(num_rows, h * G, -1, D)[:, :, :num_slots]  # (B, Hkv, S, D)
            v = layer[:num_rows, h:].reshape(num_rows, h * G, -1, D)[:, :, :num_slots]
            out.append((layer, k, v))
        return out


class StaticRunner:
    """Runs policy forwards on a StaticCache; on CUDA each (batch bucket, tokens, slots, outputs) forward of
    at most MAX_GRAPH_TOKENS tokens per row is captured in a CUDA graph on first use and replayed after."""

    def __init__(self, model: CausalLM, max_batch: int, max_len: int, cuda_graphs: bool | None = None,
                 shapes: ShapeCounts | None = None) -> None:
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"max_batch must be >= 1 and max_len >= 2, got {max_batch}, {max_len}")
        if max_len > model.cfg.max_position:
            raise ValueError(f"max_len {max_len} is beyond the model's context ({model.cfg.max_position})")
        self.model, c = model, model.cfg
        device, dtype = model.device, model.dtype
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError("cuda_graphs needs a model on a CUDA device")
        # a CPU's GEMMs on oneDNN's packed weights, as the eager path's Linear layers (drafter.model.linear.linear)
        self.onednn = device.type == "cpu" and onednn_serves(dtype)
        # decode steps' GEMMs in blocks of rows the CPU computes row by row exactly (drafter.decode.projections): a
        # verify's logits are then plain decoding's to the bit; 0: nothing split
        self.row_block = decode_row_block(model) if self.onednn else 0
        if self.onednn:
            decode_product_forms(model)  # the one- and few-row products' forms probed here, not inside a step
        self.cache = StaticCache(c, c.num_layers, batch_bucket(max_batch), max_len, dtype, device)
        B, T = self.cache.max_batch, MAX_GRAPH_TOKENS
        self.ids = torch.zeros(B * T, dtype=torch.long, device=device)  # graph inputs, (bucket * tokens) used
        self.positions = torch.zeros(B * T, dtype=torch.long, device=device)
        self.rows = torch.arange(B, device=device)
        self.slot_ids = torch.arange(max_len, device=device)
        self.rotate = rotate_half_matrix(c.head_dim, dtype, device)
        self.is_rotated = rotated_heads(c.num_heads, c.num_kv_heads, device)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None
        self.shapes = shapes if shapes is not None else ShapeCounts()
        self._views: dict[tuple[int, int], list] = {}
        self._weights_key = None
        self.weights: list[LayerWeights] = []
        self.check_weights()

    # --- weights -------------------------------------------------------------------------------------
    def _key(self) -> tuple:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def check_weights(self) -> None:
        """Re-read the layers' tensors (and drop captured graphs) when a parameter was replaced rather than
        updated in place. Cheap; the engine calls it once per generate()."""
        key = self._key()
        if key == self._weights_key:
            return
        if self.graphs:
            self.shapes.num_rebuilds += 1
        self.graphs.clear()
        self.weights = [LayerWeights(layer.input_norm.weight, layer.attn.qkv_proj.weight, layer.attn.qkv_proj.bias,
                                     layer.attn.o_proj.weight, layer.post_attn_norm.weight,
                                     layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
                                     layer.attn.o_proj.weight.t(), layer.mlp.down_proj.weight.t(),
                                     tuple(m._packed for m in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)))
                        for layer in self.model.layers]
        self._weights_key = key

    # --- the forward ---------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.model.rotary, positions, self.is_rotated, self.model.dtype)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, num_slots: int, aux: tuple[int, ...] | None,
                 logits_for: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        """ids (B*T,), positions (B, T) -> (logits (B*T', V) or None, hidden (B*T, D) or features (B*T, F)).
        Every op is on the device: capturable."""
        model, c = self.model, self.model.cfg
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        B, T = positions.shape
        views = self._views.get((B, num_slots))
        if views is None:
            views = self._views[B, num_slots] = self.cache.layer_views(B, num_slots)
        cos, sin = self._rope(positions)
        # additive mask (B, 1, T, S): 0 where slot <= position, -inf elsewhere (padding slots included); folded
        # once here for every layer's grouped heads (attend)
        mask = additive_mask(self.slot_ids[:num_slots], positions, model.dtype)
        if FOLD_GROUPS and Hkv < H:
            mask = fold_mask(mask, H // Hkv)
        rows = self.rows[:B].view(B, 1)
        onednn = self.onednn and not torch.is_grad_enabled()
        block = self.row_block if onednn and T <= MAX_GRAPH_TOKENS and logits_for != "none" else 0  # not prefills
        x = model.embed_tokens(ids)  # (B*T, hidden): the residual stream stays 2-D, updated in place
        kept = {}
        wanted = set(aux or ())
        for i, (w, (cache_l, keys, values)) in enumerate(zip(self.weights, views)):
            if i in wanted:
                kept[i], x = x, x.clone()  # the layers below add into x in place
            p_qkv, p_o, p_gate_up, p_down = w.packed
            h = F.rms_norm(x, (x.shape[-1],), w.in_norm, eps)
            qkv = project(h, w.qkv, w.qkv_bias, p_qkv, onednn, block)
            out = attend(qkv, (cos, sin), self.rotate, cache_l, keys, values, rows, positions, mask,
                         (H, Hkv, D))  # (B*T, H*D)
            x = project_into(x, out, w.o, w.o_t, p_o, onednn, block)  # residual += o_proj(out)
            h = F.rms_norm(x, (x.shape[-1],), w.post_norm, eps)
            gate, up = project(h, w.gate_up, None, p_gate_up, onednn, block).chunk(2, dim=-1)
            x = project_into(x, F.silu(gate) * up, w.down, w.down_t, p_down, onednn, block)  # += down_proj
        if len(self.weights) in wanted:
            kept[len(self.weights)] = x
        hidden = model.norm(x)
        head = model.lm_head
        if logits_for == "none":
            logits = None
        else:
            h = hidden.view(B, T, -1)[:, -1] if logits_for == "last" else hidden
            logits = project(h, head.weight, head.bias, head._packed, onednn, block) if block else head(h)
        if aux is not None:
            hidden = draft_features(hidden, torch.cat([kept[i] for i in aux], dim=-1))
        return logits, hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_slots: int,
                aux_layers: tuple[int, ...] | None = None, logits_for: str = "all"
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One policy forward of input_ids (B, T) at positions (B, T) over cache rows 0..B-1, reading slots
        [0, num_slots) (> every position: the engine knows it on the host, so no forward reads it back).
        Returns (logits (B, T, V) or (B, 1, V) or None, hidden (B, T, D) or features (B, T, F)); logits
        are valid until the next forward, hidden is the caller's."""
        B, T = input_ids.shape
        if self.cache.max_batch < B:
            raise ValueError(f"batch of {B} rows is larger than this runner's cache ({self.cache.max_batch})")
        if not 0 < num_slots <= self.cache.max_len:
            raise ValueError(f"num_slots must be in [1, {self.cache.max_len}], got {num_slots}")
        if aux_layers is not None:
            missing = sorted(set(aux_layers) - set(range(len(self.weights) + 1)))
            if missing:
                raise ValueError(f"aux_layers {missing} are not layers of this model (0..{len(self.weights)})")
        S = slot_bucket(num_slots, self.cache.max_len)
        self.cache.num_used = max(self.cache.num_used, S)
        aux = tuple(aux_layers) if aux_layers is not None else None
        # prefills (no logits) run once per batch: capturing one would cost more than it saves
        if not self.cuda_graphs or T > MAX_GRAPH_TOKENS or logits_for == "none":
            logits, hidden = self._forward(input_ids.reshape(-1), positions, S, aux, logits_for)
            return self._shape(logits, hidden, B, T, logits_for)
        Bp = batch_bucket(B)
        ids = self.ids[: Bp * T].view(Bp, T)
        pos = self.positions[: Bp * T].view(Bp, T)
        ids[:B].copy_(input_ids)
        pos[:B].copy_(positions)
        if Bp > B:  # padded rows: token 0 at slot 0 of scratch rows
            ids[B:].zero_()
            pos[B:].zero_()
        key = (Bp, T, S, aux, logits_for)
        if key not in self.graphs:  # every slot bucket of this shape at once: a sequence goes through them all
            for s in slot_buckets(self.cache.max_len):
                self._capture((Bp, T, s, aux, logits_for), ids, pos)
        graph, (logits, hidden) = self.graphs[key]
        graph.replay()
        logits, hidden = self._shape(logits, hidden, Bp, T, logits_for)
        return (None if logits is None else logits[:B]), hidden[:B].clone()

    @staticmethod
    def _shape(logits, hidden, B, T, logits_for):
        if logits is not None:
            logits = logits.view(B, 1 if logits_for == "last" else T, -1)
        return logits, hidden.view(B, T, -1)

    def _capture(self, key: tuple, ids: torch.Tensor, pos: torch.Tensor) -> None:
        """Capture one shape. Its warm-up runs on the step's real inputs: the K/V it writes are the step's own
        (they depend on the inputs only), and its outputs are overwritten by the replay that follows."""
        _, _, S, aux, logits_for = key
        graph, outputs = capture(lambda: self._forward(ids.reshape(-1), pos, S, aux, logits_for), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, outputs)
        self.shapes.num_captures += 1
