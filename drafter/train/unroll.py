"""Training-time unrolling (EAGLE-3's "training-time test"): the head's forward over packed rollouts
for draft steps 0..num_unroll-1 at once, and the attention kernels it runs on.

At inference, draft step s > 0 feeds the head its own previous output instead of the fused policy
states. Unroll step s reproduces that: slot j's input hidden is step s-1's output at slot j-1,
and its attention sees exactly what it would see at inference: the true-feature keys of its chain's
past (positions <= j - s) plus the keys its own chain produced at steps 1..s (one per step, on the
diagonal). Step 0 is plain causal attention within each packed segment, so on a GPU it can run on
flash-attn's varlen kernel over the real slots only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from drafter.draft.head import EagleHead
from drafter.model.causal_lm import apply_rotary
from drafter.train.buffer import PackedBatch

# The attention backends the unrolled forward may use: all but cuDNN's. Under bf16 on Hopper, torch sends masked
# SDPA to cuDNN attention, which builds an execution plan for every new shape, and packed batches bring new shapes
# at every micro-step (R, T, and the (R, 1, T, T*(s+1)) masks): bf16 autocast trained 22x slower than float32 on
# an H100 (1.6k against 36.4k tokens/s); float32 never goes to cuDNN. Without it (H100, torch 2.11, SmolLM2's
# head shape): bf16 20k-29k tokens/s, float32 32k, bf16 with cuDNN allowed 1.8k (its kernels in the profile).
# `tlt bench gpu` measures the ratio (train_bf16_over_fp32). No effect on a CPU, which has no cuDNN backend.
UNROLL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     repeat_kv: bool | None = None) -> torch.Tensor:
    """SDPA of q (R, H, T, D) over k, v (R, Hkv, S, D) under a mask. repeat_kv (None: on a GPU) repeats each KV
    head per query head of its group first: torch's fused CUDA kernels take a mask only without enable_gqa, and
    with it fall back to the math path (one matmul and softmax per op, in float32 under autocast). A CPU's
    kernel groups the heads itself."""
    group = q.shape[1] // k.shape[1]
    if (q.is_cuda if repeat_kv is None else repeat_kv) and group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (R, H, S, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (R, T, ...) -> y with y[:, j] = x[:, j - n] (the first n slots are zeros)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], dim=1)


@dataclass
class VarlenLayout:
    """Packed rows flattened for a variable-length attention kernel: the real slots, segment by segment."""

    index: torch.Tensor  # (N,) flat slot index into (R*T) of every real pair, in segment order
    cu_seqlens: torch.Tensor  # (S+1,) int32 cumulative segment lengths
    max_len: int


def varlen_layout(seq_ids: torch.Tensor) -> VarlenLayout:
    """Segments are contiguous runs of one seq id within a row (ids are unique across the batch) and
    their slots are in position order, so flat slot order is segment order."""
    flat = seq_ids.reshape(-1)
    index = (flat >= 0).nonzero().squeeze(1)
    _, counts = torch.unique_consecutive(flat[index], return_counts=True)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=seq_ids.device)
    cu[1:] = counts.cumsum(0)
    return VarlenLayout(index, cu, int(counts.max()) if counts.numel() else 0)


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True):
    """flash_attn_varlen_func's contract in plain torch, (N, H, D) in and out: the CPU counterpart
    the GPU kernel is tested against (training without flash-attn stays on masked SDPA, not this)."""
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise ValueError("the reference kernel needs the same segments for queries and keys")
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=causal,
            enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
    return out


def flash_varlen_kernel():
    """flash-attn's varlen kernel when it is installed and a GPU is present, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_step0_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout,
                           kernel) -> torch.Tensor:
    """Unroll step 0 is plain causal attention within each packed segment: run it as a varlen kernel
    over the real slots only. q (R, H, T, D), k/v (R, Hkv, T, D) -> (R, H, T, D); padding slots get
    zeros (their outputs are never in a loss, and later steps only let them attend to themselves)."""
    R, H, T, D = q.shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(R * T, x.shape[1], D)[layout.index]

    qf, kf, vf = flat(q), flat(k), flat(v)
    half = q.dtype if q.dtype in (torch.float16, torch.bfloat16) or kernel is varlen_attention_reference \
        else torch.bfloat16  # flash-attn takes half precision only
    out = kernel(qf.to(half), kf.to(half), vf.to(half), layout.cu_seqlens, layout.cu_seqlens, layout.max_len,
                 layout.max_len, causal=True).to(q.dtype)
    full = torch.zeros(R * T, H, D, dtype=q.dtype, device=q.device).index_copy(0, layout.index, out)
    return full.view(R, T, H, D).transpose(1, 2)


def _stop_in_backward(x: torch.Tensor, check_stop: Callable[[], None] | None) -> None:
    """Check for a stop when backward reaches `x` too: the backward pass is most of a micro-step, and
    an exception raised in a gradient hook aborts it (the trainer then drops the partial gradients)."""
    if check_stop is not None and x.requires_grad:
        x.register_hook(lambda grad: check_stop())


def unrolled_predictions(head: EagleHead, embed: torch.nn.Embedding, batch: PackedBatch,
                         num_unroll: int, check_stop: Callable[[], None] | None = None,
                         varlen_kernel=None) -> list[torch.Tensor]:
    """The head's layer outputs (before the final norm: head.logits scores them) for unroll steps
    0..num_unroll-1, each (R, T, D). Step 0 takes fc over the recorded aux states (head.fuse); step s
    takes step s-1's output at the slot before, as drafting feeds its own output back. With
    `varlen_kernel` (flash-attn's on a GPU) step 0 runs it over the packed segments; later steps need
    keys from other steps on the diagonal, which no varlen kernel expresses, so they stay on masked SDPA."""
    feats = batch.feats
    if feats.shape[-1] != head.feature_size:
        raise ValueError(f"the batch's features are {feats.shape[-1]} wide; this head takes {head.feature_size} "
                         f"(three aux layers' states and the final hidden state, each {head.policy_cfg.hidden_size}): "
                         "rollouts recorded for another head layout or policy")
    with sdpa_kernel(UNROLL_SDPA_BACKENDS):  # the backward follows the kernels the forward picked
        return _unrolled(head, embed, batch, num_unroll, check_stop, varlen_kernel)


def _unrolled(head: EagleHead, embed: torch.nn.Embedding, batch: PackedBatch, num_unroll: int,
              check_stop: Callable[[], None] | None, varlen_kernel) -> list[torch.Tensor]:
    feats, positions, seq = batch.feats, batch.positions, batch.seq_ids
    layout = varlen_layout(seq) if varlen_kernel is not None else None
    R, T, _ = feats.shape
    emb = embed(batch.tokens).to(feats.dtype)  # (R, T, D), frozen; in the head's dtype (bf16 when it trains in bf16)
    rope = head.rotary(positions, feats.dtype)
    same = (seq[:, :, None] == seq[:, None, :]) & (seq[:, :, None] >= 0)  # (R, Tq, Tk)
    eye = torch.eye(T, dtype=torch.bool, device=feats.device).expand(R, T, T)
    layer = head.midlayer
    attn = layer.self_attn
    step_keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    preds, hidden = [], head.fuse(feats)  # (R, T, 4D) -> (R, T, D)
    for s in range(num_unroll):
        if check_stop is not None:
            check_stop()
        # keys visible to step s at query slot j: true keys at positions <= pos_j - s ...
        base = same & (positions[:, None, :] <= positions[:, :, None] - s)  # (R, Tq, Tk)
        # ... and step t's key at slot j - (s - t), t = 1..s (shifted onto the diagonal)
        masks = [base] + [eye] * s
        mask = torch.cat(masks, dim=-1).unsqueeze(1)  # (R, 1, T, T*(s+1))
        # no chain of s steps inside the segment (or padding): attend to itself, never to nothing
        lonely = (positions - batch.seg_start < s) | (seq < 0)
        mask[..., :T] |= eye.unsqueeze(1) & lonely.view(R, 1, T, 1)
        q, k, v = attn.qkv_proj(layer.attn_input(hidden, emb)).split(attn.split, dim=-1)  # (R, T, 2D) in
        q = apply_rotary(q.view(R, T, attn.num_heads, attn.head_dim), *rope).transpose(1, 2)  # (R, H, T, D)
        k = apply_rotary(k.view(R, T, attn.num_kv_heads, attn.head_dim), *rope).transpose(1, 2)
        v = v.view(R, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # (R, Hkv, T, D)
        step_keys.append((k, v))
        ks = [step_keys[0][0]] + [_shift_right(step_keys[t][0].transpose(1, 2), s - t).transpose(1, 2)
                                  for t in range(1, s + 1)]
        vs = [step_keys[0][1]] + [_shift_right(step_keys[t][1].transpose(1, 2), s - t).transpose(1, 2)
                                  for t in range(1, s + 1)]
        if s == 0 and layout is not None:
            out = varlen_step0_attention(q, k, v, layout, varlen_kernel)
        else:
            out = masked_attention(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask)  # (R, H, T, D)
        attn_out = attn.o_proj(out.transpose(1, 2).reshape(R, T, -1))  # (R, T, D)
        _stop_in_backward(attn_out, check_stop)
        x = layer.finish(hidden, attn_out)
        _stop_in_backward(x, check_stop)
        preds.append(x)
        hidden = _shift_right(x, 1)  # slot j's next input is this step's output at slot j-1
    return preds


@dataclass
class LossIndex:
    """Where the loss reads a packed batch, as flat slot indices into its (R*T) slots, in loss_mask's order:
    built where the batch's masks are (on the CPU, before the batch moves to its head's device), because a
    boolean mask indexing a GPU tensor makes the host wait for the device to count the mask's Trues."""

    first: torch.Tensor  # (N,) slot of every pair step 0 trains (loss_mask(batch, 0)); its target is slot + 1
    # per unroll step s that has pairs: (s, the slots of its pairs (n,), where they are among `first` (n,))
    steps: list[tuple[int, torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, batch: PackedBatch, num_unroll: int) -> LossIndex:
        R, T = batch.positions.shape
        slot = torch.arange(R * T, device=batch.positions.device).view(R, T)[:, :-1]  # (R, T-1): pair j's slot
        first = loss_mask(batch, 0)
        first_flat = first.flatten()
        steps = []
        for s in range(num_unroll):
            valid = (first if s == 0 else loss_mask(batch, s)).flatten()  # (R*(T-1),): among step 0's pairs
            if bool(valid.any()):
                steps.append((s, slot.flatten()[valid], valid[first_flat].nonzero().squeeze(1)))
        return cls(slot[first], steps)

    def to(self, device: torch.device | str) -> LossIndex:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)  # from pageable memory: staged at once, no stream sync

        return LossIndex(move(self.first), [(s, move(a), move(b)) for s, a, b in self.steps])


def loss_mask(batch: PackedBatch, step: int, response_only: bool = False) -> torch.Tensor:
    """(R, T-1) bool: the pairs whose unroll step `step` is trained: the prediction at pair j of step s
    comes from a chain rooted at pair j - s, which must lie in the same packed segment (a long
    rollout cut into chunks starts its chains afresh in each chunk), and the pair needs a target.
    response_only: the root must also be where decoding drafts, from the prompt's last pair on
    (PackedBatch.response_start; the prompt's pairs stay the chains' context): what the offline scorer counts.
    Training keeps every root: on SmolLM2's longtail job rollouts (45% of their pairs prompt-rooted), 40 s
    fine-tunes of the shipped draft scored the same either way (T=1, k=4: 1.704-1.708, two seeds each)."""
    root = batch.positions[:, :-1] - step
    mask = batch.target_mask[:, :-1] & (root >= batch.seg_start[:, :-1])
    if response_only and batch.response_start is not None:
        mask &= root >= batch.response_start[:, :-1]
    return mask
