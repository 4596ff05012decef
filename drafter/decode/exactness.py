"""Whether the static path's decode steps give a verify's logits plain decoding's bits on this CPU: a verify of
k + 1 tokens per row against the same tokens decoded one at a time, on a random model of SmolLM2-135M's shapes
(drafter.decode.projections has why, and the row blocks that make it so where the GEMMs allow). Coupled jobs ask
it before serving bf16 (workers.device.bf16_rows_exact)."""

from __future__ import annotations

import functools

import torch

from drafter.decode.static import StaticRunner
from drafter.model.config import ModelConfig
from drafter.model.loading import random_model


def verify_and_one_at_a_time(model, row_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The logits of 17 rows x 4 tokens (68 GEMM rows) verified in one static forward after a prefill (reading 64
    slots), and of the same tokens decoded one at a time (reading 128: another slot bucket); row_block overrides
    the runners' own, which is returned too."""
    B, P, T = 17, 20, 4
    g = torch.Generator().manual_seed(0)
    # drawn by the CPU generator, then on the model's device
    prompt = torch.randint(0, model.cfg.vocab_size, (B, P), generator=g, device="cpu").to(model.device)
    tokens = torch.randint(0, model.cfg.vocab_size, (B, T), generator=g, device="cpu").to(model.device)
    logits, own = [], 0
    with torch.inference_mode():
        for one_at_a_time in (False, True):
            runner = StaticRunner(model, max_batch=B, max_len=128)
            own = runner.row_block
            if row_block is not None:
                runner.row_block = row_block
            runner.forward(prompt, torch.arange(P, device=model.device).expand(B, P), P, logits_for="none")
            if one_at_a_time:
                got = torch.cat([runner.forward(tokens[:, j:j + 1],
                                                torch.full((B, 1), P + j, device=model.device), 128)[0]
                                 for j in range(T)], dim=1)
            else:
                got = runner.forward(tokens, P + torch.arange(T, device=model.device).expand(B, T), P + T)[0]
            logits.append(got.clone())
    return logits[0], logits[1], own


# SmolLM2-135M's layer shapes (a GEMM's kernel is its shapes'), two layers and a small vocabulary: what
# verify_is_plain decodes
SMOLLM2_SHAPES = dict(vocab_size=512, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position=512)


@functools.cache
def verify_is_plain(dtype: torch.dtype) -> bool:
    """Whether this CPU's static path gives a verify's logits the bits of one-token forwards in `dtype`
    (verify_and_one_at_a_time on a random model of SMOLLM2_SHAPES): GEMMs in row blocks, SDPA over slot buckets,
    norms and the LM head all together. Once per dtype and process."""
    verified, one_at_a_time, _ = verify_and_one_at_a_time(random_model(ModelConfig(**SMOLLM2_SHAPES), 0, dtype))
    return torch.equal(verified, one_at_a_time)
