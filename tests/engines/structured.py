"""A tiny policy with structure that vLLM's CPU kernels serve (head_dim 32: its attention's smallest), and an
EAGLE-3 draft trained on its rollouts: acceptance that a draft swap visibly changes, in about a minute."""

from __future__ import annotations

import torch

from drafter.decode.engine import Engine
from drafter.draft.head import EagleHead, new_head
from drafter.model.causal_lm import CausalLM
from drafter.model.config import ModelConfig, TrainConfig
from drafter.train.buffer import RolloutBuffer
from drafter.train.trainer import DraftTrainer
from drafter.train.warmstart import HarvestConfig, harvest
from tests.conftest import fit_patterns, pattern_corpus

VOCAB = 48  # pattern_corpus's tokens
CFG = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=2, num_kv_heads=1,
                  head_dim=32, max_position=256, rope_theta=10000.0, tie_word_embeddings=True)


def structured_policy(steps: int = 150) -> CausalLM:
    """Trained `steps` steps on pattern_corpus: within a word the next token is certain, across words not."""
    torch.manual_seed(0)
    model = CausalLM(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.02)
    return fit_patterns(model, steps, batch_size=16)


def held_out_prompts(num: int = 8) -> list[list[int]]:
    return [p[:6].tolist() for p in pattern_corpus(num, VOCAB, seed=20_000)]


def trained_head(policy: CausalLM, steps: int = 100) -> EagleHead:
    """An EAGLE-3 head trained `steps` steps on the policy's sampled rollouts."""
    buffer = RolloutBuffer(max_bytes=64 << 20)
    prompts = [p[:6].tolist() for p in pattern_corpus(48, VOCAB, seed=10_000)]
    harvest(Engine(policy), prompts, buffer, cfg=HarvestConfig(batch_size=48, max_new_tokens=40, temperature=1.0))
    head = new_head(policy, None, None)
    cfg = TrainConfig(anneal_to_budget=False, bf16_autocast=False, total_steps=steps)
    DraftTrainer(policy, head, cfg).train(buffer, max_steps=steps)
    return head.eval()
