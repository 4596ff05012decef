"""Shared fixtures: tiny random models (fast, for exactness tests) built in-test."""

from __future__ import annotations

import pytest
import torch

from drafter.model import CausalLM, ModelConfig


def tiny_model(vocab_size: int = 64, seed: int = 0, std: float = 0.3, max_position: int = 512,
               attention_bias: bool = False, tie: bool = True, eos: tuple[int, ...] = ()) -> CausalLM:
    """A 2-layer model with large random weights: peaked, repetitive outputs, so drafts get accepted."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=max_position, attention_bias=attention_bias,
                      tie_word_embeddings=tie, eos_token_ids=eos)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, std)
    return model.requires_grad_(False)


@pytest.fixture(scope="session")
def tiny() -> CausalLM:
    return tiny_model()


@pytest.fixture(scope="session")
def tiny_qwen2() -> CausalLM:
    return tiny_model(seed=1, attention_bias=True, tie=False)


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
