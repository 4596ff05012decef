"""Row blocks (drafter.decode.projections): where this CPU's packed GEMMs keep each row's bits in blocks of rows, a
verify forward of k + 1 tokens per row gives plain decoding's logits to the bit on the static path, whatever the
batch; where they do not, nothing is split. Real oneDNN kernels, real tiny models; the block is the CPU's own."""

from __future__ import annotations

import pytest
import torch

from drafter.decode.exactness import SMOLLM2_SHAPES, verify_and_one_at_a_time, verify_is_plain
from drafter.decode.projections import (
    MIN_ROW_BLOCK,
    ROW_PROBE_MAX,
    decode_linears,
    decode_row_block,
    first_parting_rows,
    project,
    row_block,
)
from drafter.model.config import ModelConfig
from drafter.model.linear import PackedWeight, onednn_serves
from drafter.model.loading import random_model
from workers.device import bf16_rows_exact, policy_dtype

DTYPES = [torch.float32, torch.bfloat16]
SHAPE = (SMOLLM2_SHAPES["intermediate_size"], SMOLLM2_SHAPES["hidden_size"])  # a GEMM shape to probe
# other values than row_block's probe (seed 0): the blocking is the shapes'. Both forms count (plain and fused add):
# they part apart, on an AMD EPYC (Zen 4) in bf16 the 576 x 1536 GEMM kept rows to 38 plain and to 7 fused
OTHER_SEED = 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_block_keeps_every_rows_bits_and_blocked_projections_do_too(dtype):
    """Within the probed block a GEMM's rows are the rows alone (on other values than the probe's); a projection of
    more rows in blocks is each row alone too; 0 only where the kernel parts rows below MIN_ROW_BLOCK."""
    if not onednn_serves(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (no bf16 units): no packed GEMM to probe")
    block = row_block(dtype, *SHAPE)
    parting = first_parting_rows(dtype, *SHAPE, seed=OTHER_SEED)
    if block == 0:
        assert parting is not None and parting <= MIN_ROW_BLOCK
        return
    assert MIN_ROW_BLOCK <= block <= ROW_PROBE_MAX and (parting is None or parting > block)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(*SHAPE, generator=g).to(dtype)
    h = torch.randn(3 * block + 5, SHAPE[1], generator=g).to(dtype)
    packed = PackedWeight()
    with torch.inference_mode():
        blocked = project(h, weight, None, packed, True, block)
        alone = torch.cat([project(row, weight, None, packed, True) for row in h.split(1)])
    assert torch.equal(blocked, alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verify_forward_gives_plain_decodings_logits_to_the_bit_where_rows_are_blocked(dtype):
    """A 2-layer random model of SmolLM2-135M's shapes on the static path: a verify of 68 GEMM rows against the same
    tokens one at a time over another slot bucket. Where the runner blocks rows and the rest of the path keeps a
    row's bits (an AMX Xeon in bf16: verify_is_plain, which coupled jobs ask), the logits are equal to the bit, and
    unblocked they part where a GEMM of these shapes parts rows within 68; where the runner cannot block
    (row_block 0), some GEMM of the model parts rows below MIN_ROW_BLOCK (float32 where the GEMV differs from the
    GEMM: a ~1e-7 difference)."""
    if not onednn_serves(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (no bf16 units): the static path runs F.linear")
    model = random_model(ModelConfig(**SMOLLM2_SHAPES), 0, dtype)
    shapes = [tuple(m.weight.shape) for m in decode_linears(model)]
    parting = [m for s in shapes if (m := first_parting_rows(dtype, *s, seed=OTHER_SEED)) is not None]
    verified, one_at_a_time, block = verify_and_one_at_a_time(model)
    assert block == decode_row_block(model)
    if block == 0:
        assert min(parting) <= MIN_ROW_BLOCK
        return
    exact = torch.equal(verified, one_at_a_time)  # where SDPA or a norm parted rows too, coupled jobs serve float32
    assert exact == verify_is_plain(dtype)
    if exact and parting and min(parting) <= 68:  # teeth: unblocked, the verify's GEMMs part rows, the logits too
        unblocked, plain, _ = verify_and_one_at_a_time(model, row_block=0)
        assert not torch.equal(unblocked, plain)


def test_coupled_jobs_serve_bf16_only_where_rows_keep_their_bits():
    """auto, for coupled sampling: bf16 on a CPU whose bf16 GEMMs keep rows in blocks, float32 elsewhere and on a
    GPU (its kernels are not probed); named precisions stay what they say."""
    assert policy_dtype("auto", "cpu", coupled=True) == (torch.bfloat16 if bf16_rows_exact() else torch.float32)
    assert policy_dtype("auto", "cuda", coupled=True) == torch.float32
    assert policy_dtype("bfloat16", "cpu", coupled=True) == torch.bfloat16
    assert policy_dtype("float32", "cpu", coupled=True) == torch.float32
    assert bf16_rows_exact() == (onednn_serves(torch.bfloat16) and verify_is_plain(torch.bfloat16))
