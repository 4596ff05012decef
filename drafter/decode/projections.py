"""The static path's projections (x @ W.T on a CPU's oneDNN packed weights or F.linear), and row blocks: the most
input rows a CPU's packed GEMM computes each row of to the bits that row gets alone.

Why row blocks: a speculative step verifies k + 1 tokens per row, so its GEMMs see (k + 1) times plain decoding's
rows. Where a GEMM's kernel changes with the number of rows (oneDNN's bf16 GEMMs on an AMX Xeon: each row's bits are
its own up to 32 rows and differ from 33 up, for every SmolLM2 weight shape), a verify's logits part from a one-token
forward's by an ulp now and then, in bf16 enough to move a coupled sample (drafter.decode.coupled) within tens of
tokens; greedy rows could part likewise where two logits nearly tie. Fed in blocks of at most `row_block` rows,
every decode step's rows get plain decoding's bits whatever the batch and draft length. `row_block` probes the
CPU once per (dtype, weight shape); 0 where fewer than MIN_ROW_BLOCK rows keep their bits (float32 there: its GEMV
and GEMM part at 2 rows by ~1e-7, which coupled samples survive), and then nothing is split. Prefills, whose
shapes both sides share, are never split."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from drafter.model.linear import PackedWeight, product_form, product_forms, small_product

ROW_PROBE_MAX = 64  # the most rows the probe tries (a block of at least this many: nothing to split in practice)
MIN_ROW_BLOCK = 8  # a block below this would cost more than it keeps: row_block says 0 (nothing split) then


@functools.cache
def row_block(dtype: torch.dtype, out_features: int, in_features: int) -> int:
    """The largest M <= ROW_PROBE_MAX such that oneDNN's packed GEMM in `dtype` on this CPU computes every row of
    an input of up to M rows exactly as that row alone (the plain GEMM and the one with a fused add); 0 where that
    is fewer than MIN_ROW_BLOCK rows. Seeded random weights: a kernel's row blocking depends on the shapes, not on
    the values. About 0.1-0.5 s once per (dtype, shape) and process."""
    m = first_parting_rows(dtype, out_features, in_features, seed=0)
    if m is None:
        return ROW_PROBE_MAX
    return m - 1 if m - 1 >= MIN_ROW_BLOCK else 0


def first_parting_rows(dtype: torch.dtype, out_features: int, in_features: int, seed: int) -> int | None:
    """The fewest rows (2..ROW_PROBE_MAX) for which oneDNN's packed GEMM in `dtype`, plain or with the residual's add
    fused (`project`, `project_into`: both forms a decode step runs), gives some row other bits than that row alone,
    on random values drawn from `seed`; None where no count up to ROW_PROBE_MAX does."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g, device="cpu") / in_features ** 0.5).to(dtype)
    x = torch.randn(ROW_PROBE_MAX, in_features, generator=g, device="cpu").to(dtype)
    res = torch.randn(ROW_PROBE_MAX, out_features, generator=g, device="cpu").to(dtype)
    packed = PackedWeight()
    with torch.inference_mode():
        alone = torch.cat([project(x[i:i + 1], weight, None, packed, True) for i in range(ROW_PROBE_MAX)])
        alone_add = torch.cat([project_into(res[i:i + 1], x[i:i + 1], weight, weight.t(), packed, True)
                               for i in range(ROW_PROBE_MAX)])
        for m in range(2, ROW_PROBE_MAX + 1):
            if not (torch.equal(project(x[:m], weight, None, packed, True), alone[:m])
                    and torch.equal(project_into(res[:m], x[:m], weight, weight.t(), packed, True), alone_add[:m])):
                return m
    return None


def project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight,
            onednn: bool, block: int = 0) -> torch.Tensor:
    """h (N, in) @ weight.T + bias -> (N, out), one op: oneDNN's GEMM on pre-packed weights on a CPU
    (flat in N where MKL's grows, drafter.model.linear.linear; one row as MKL's GEMV where one_row_form says, a few
    on the few-row kernel where skinny_rows says), else F.linear. block > 0: in row blocks of at most that many
    (row_block)."""
    if onednn:
        if 0 < block < h.shape[0]:
            return torch.cat([project(part, weight, bias, packed, True) for part in h.split(block)])
        form = product_form(h, weight)
        if form != "onednn":
            return small_product(h, weight, bias, packed, form)
        return torch.ops.mkldnn._linear_pointwise(h, packed.get(weight), bias, "none", [], "")
    return F.linear(h, weight, bias)


def project_into(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor,
                 packed: PackedWeight, onednn: bool, block: int = 0) -> torch.Tensor:
    """The residual stream plus a projection, x + h @ weight.T, one op: in place on a GPU (addmm_: a captured
    graph's stream stays put), on a CPU oneDNN's GEMM with the add fused (in row blocks, as `project`; one row or a
    few in the forms product_form says)."""
    if onednn:
        if 0 < block < h.shape[0]:
            return torch.cat([project_into(xp, hp, weight, weight_t, packed, True)
                              for xp, hp in zip(x.split(block), h.split(block))])
        form = product_form(h, weight)
        if form != "onednn":
            return small_product(h, weight, None, packed, form, residual=x)
        return torch.ops.mkldnn._linear_pointwise.binary(h, x, packed.get(weight), None, "add")
    return x.addmm_(h, weight_t)


def decode_linears(model) -> tuple:
    """A CausalLM's GEMMs of a decode step, one per weight shape (its first layer's, alike in every layer, and the
    LM head), cheapest first."""
    layer = model.layers[0]
    return layer.attn.o_proj, layer.attn.qkv_proj, layer.mlp.down_proj, layer.mlp.gate_up_proj, model.lm_head


def decode_product_forms(model) -> tuple[tuple[str, frozenset[int]], ...]:
    """product_forms for each of decode_linears' weight shapes: asked when a runner is built."""
    return product_forms(model.dtype, tuple(tuple(linear.weight.shape) for linear in decode_linears(model)))


def decode_row_block(model) -> int:
    """The row block of a CausalLM's decode steps: the smallest `row_block` of decode_linears' weight shapes; 0 as
    soon as one is 0."""
    block = ROW_PROBE_MAX
    for linear in decode_linears(model):
        block = min(block, row_block(model.dtype, *linear.weight.shape))
        if block == 0:
            break
    return block
