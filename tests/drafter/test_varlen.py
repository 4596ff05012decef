"""Unroll step 0 on a varlen attention kernel over packed segments equals the masked-SDPA path.
CPU: the reference kernel (flash-attn's contract in plain torch); GPU: flash-attn itself."""

from __future__ import annotations

import pytest
import torch

from drafter.draft.head import EagleConfig, EagleHead
from drafter.model.causal_lm import draft_features
from drafter.model.config import default_aux_layer_ids
from drafter.train.buffer import RolloutBuffer, iter_batches
from drafter.train.unroll import flash_varlen_kernel, unrolled_predictions, varlen_attention_reference, varlen_layout
from tests.conftest import random_prompts, tiny_model


def packed_batch(model, lengths):
    """Rollouts of the given lengths packed into short rows: several segments per row, padding, and
    a long sequence cut into chunks."""
    buffer = RolloutBuffer(max_bytes=1 << 24, hidden_dtype=torch.float32)
    for seq in random_prompts(lengths, model.cfg.vocab_size, seed=7):
        L = len(seq)
        _, hidden, aux = model(torch.tensor([seq]), torch.arange(L)[None], model.new_cache(1, L), logits_for="none",
                               aux_layers=default_aux_layer_ids(model.cfg.num_layers))
        buffer.add(torch.tensor(seq), draft_features(hidden, aux)[0, :-1], policy_version=0)
    return next(iter_batches(buffer, max_tokens_per_row=24, num_rows=4, shuffle=True, seed=1))


def test_layout_lists_real_slots_segment_by_segment():
    seq = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]])
    lay = varlen_layout(seq)
    assert lay.index.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 9] and lay.max_len == 4


@torch.no_grad()
def test_varlen_step0_matches_masked_sdpa_on_cpu():
    model = tiny_model(seed=3).double()
    head = EagleHead(model.cfg, EagleConfig(init_seed=1)).double().eval()
    batch = packed_batch(model, [9, 30, 5, 14, 11, 7])
    batch.feats = batch.feats.double()
    assert (batch.seq_ids < 0).any() and batch.num_sequences > batch.feats.shape[0]  # padding and packing
    masked = unrolled_predictions(head, model.embed_tokens, batch, num_unroll=3)
    varlen = unrolled_predictions(head, model.embed_tokens, batch, num_unroll=3,
                                  varlen_kernel=varlen_attention_reference)
    real = batch.seq_ids >= 0
    for s in range(3):  # later steps read step 0's keys, so they must agree too
        torch.testing.assert_close(varlen[s][real], masked[s][real], atol=1e-9, rtol=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(flash_varlen_kernel() is None, reason="needs a GPU with flash-attn installed")
@torch.no_grad()
def test_flash_attn_varlen_matches_the_reference_kernel():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 17, 18, 40], dtype=torch.int32, device="cuda")
    q = torch.randn(40, 8, 64, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(40, 2, 64, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(40, 2, 64, generator=g).to("cuda", torch.bfloat16)
    got = flash_varlen_kernel()(q, k, v, cu, cu, 22, 22, causal=True)
    ref = varlen_attention_reference(q.float(), k.float(), v.float(), cu, cu, 22, 22, causal=True)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
