"""EAGLE-style draft head: one decoder layer over (policy hidden state, next token embedding).

The head lags the policy by one position: the pair (h_i, t_{i+1}) - the policy's final hidden
state at position i and the token that followed - predicts h_{i+1}, and the policy's own LM head
turns that prediction into a distribution over t_{i+2}. Embedding and LM head are shared with
the policy (not copied), so the head's own weights are one layer plus a projection.

Also the head's factories: a fresh head (new_head), the config a checkpoint records (head_config)
and the head a checkpoint describes (head_from_config, head_from_state).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from drafter.buffer import RolloutBuffer
from drafter.config import ModelConfig
from drafter.model import (
    CausalLM,
    DecoderLayer,
    KVCache,
    Linear,
    PackedWeight,
    RMSNorm,
    Rotary,
    linear,
    tree_inputs,
)


@dataclass
class EagleConfig:
    num_layers: int = 1  # EAGLE: one layer is enough to reach most of the acceptance
    # Score only this many tokens (the most frequent in rollouts, as EAGLE-3 does): the LM head is
    # a fifth of SmolLM2's weights, and each draft step would otherwise pay for all of it.
    draft_vocab_size: int | None = None  # None = the policy's full vocabulary
    init_seed: int = 0
    # Sampled rows draft from the job's sampling distribution over logits / draft_temperature (0: the
    # argmax). Rejection sampling stays exact for any draft distribution q; what it accepts against the
    # target p, sum min(p, q), is highest for q = p, so a head whose q is flatter than p accepts more
    # with a sharper q. Which one wins is measured: calibrate_draft_temperature (drafter.evaluate) on
    # held-out rollouts. SmolLM2's warm-started head scored best at 1.0 (docs/benchmarks.md).
    draft_temperature: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.draft_temperature, (int, float)) or not 0 <= self.draft_temperature <= 10:
            raise ValueError(f"draft_temperature must be in [0, 10], got {self.draft_temperature!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class EagleHead(nn.Module):
    def __init__(self, policy_cfg: ModelConfig, cfg: EagleConfig | None = None, init: bool = True) -> None:
        """init=False leaves the weights uninitialised, for a head about to load a checkpoint (a
        hot swap: random init is most of the cost of building a SmolLM2-size head)."""
        super().__init__()
        self.cfg = cfg or EagleConfig()
        self.policy_cfg = policy_cfg
        d = policy_cfg.hidden_size
        self.fc = Linear(2 * d, d, bias=False)  # fuse [embedding(t_{i+1}); h_i]
        self.layers = nn.ModuleList(DecoderLayer(policy_cfg) for _ in range(self.cfg.num_layers))
        self.norm = RMSNorm(d, policy_cfg.rms_norm_eps)
        # drafting runs up to k positions past the policy's context: give the table room for it
        self.rotary = Rotary(policy_cfg.head_dim, 2 * policy_cfg.max_position, policy_cfg.rope_theta)
        if init:
            gen = torch.Generator().manual_seed(self.cfg.init_seed)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02, generator=gen)
        num_draft = self.cfg.draft_vocab_size or policy_cfg.vocab_size
        if not 0 < num_draft <= policy_cfg.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {policy_cfg.vocab_size}], got {num_draft}")
        # policy token id of each draft-vocabulary entry; set_vocab picks them from rollouts
        self.register_buffer("vocab_ids", torch.arange(num_draft, dtype=torch.long))

    def set_vocab(self, token_counts: torch.Tensor, always: tuple[int, ...] = ()) -> None:
        """Keep the most frequent tokens (counts: (V,) over the policy vocabulary) plus `always` (EOS)."""
        n = self.vocab_ids.numel()
        counts = token_counts.double().clone()
        counts[list(always)] = float("inf")
        ids = counts.topk(n).indices.sort().values
        self.vocab_ids.copy_(ids)

    def draft_logits(self, predicted: torch.Tensor, lm_weight: torch.Tensor,
                     packed: PackedWeight | None = None) -> torch.Tensor:
        """(..., D) predicted features -> (..., V') logits over the draft vocabulary;
        lm_weight is the policy's LM head restricted to vocab_ids: (V', D). `packed`: its oneDNN
        copy for CPU inference (see drafter.model.linear)."""
        return linear(predicted, lm_weight, None, packed)

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.policy_cfg
        return KVCache(self.cfg.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim, dtype, device)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """features, token_embeds: (B, T, D); positions (B, T). Returns predicted features (B, T, D).
        tree: (slots, mask) of a draft tree's nodes, as in CausalLM.forward."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))  # (B, T, 2D) -> (B, T, D)
        rope = self.rotary(positions, x.dtype)
        slots, mask, num_slots = tree_inputs(positions, cache, tree)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache, i, slots, mask, num_slots)
        return self.norm(x)


def draft_lm_weight(head: EagleHead, policy: CausalLM) -> torch.Tensor:
    """The policy's LM head restricted to the head's draft vocabulary, (V', D): what draft_logits takes."""
    return policy.lm_head.weight[head.vocab_ids]


def token_counts(buffer: RolloutBuffer, vocab_size: int) -> torch.Tensor:
    """(V,) how often each policy token occurs in the buffer's rollouts."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in buffer.rollouts:
        counts += torch.bincount(r.tokens.long(), minlength=vocab_size)
    return counts


def new_head(policy: CausalLM, buffer: RolloutBuffer | None, draft_vocab_size: int | None, seed: int = 0) -> EagleHead:
    """A fresh head; with a buffer, its draft vocabulary is the buffer's most frequent tokens."""
    if draft_vocab_size is not None and draft_vocab_size >= policy.cfg.vocab_size:
        draft_vocab_size = None
    head = EagleHead(policy.cfg, EagleConfig(draft_vocab_size=draft_vocab_size, init_seed=seed))
    if buffer is not None and draft_vocab_size is not None:
        head.set_vocab(token_counts(buffer, policy.cfg.vocab_size), always=policy.cfg.eos_token_ids)
    return head.to(policy.dtype)


def head_config(head: EagleHead) -> dict:
    """What a checkpoint records to rebuild the head (DraftMeta.head_config)."""
    return {"policy": head.policy_cfg.to_dict(), "eagle": head.cfg.to_dict()}


def head_from_config(config: dict, init: bool = False) -> EagleHead:
    """The head a checkpoint's head_config describes; its weights are left for load_state_dict
    unless init (then: the seeded initialisation a new head gets)."""
    return EagleHead(ModelConfig.from_dict(config["policy"]), EagleConfig(**config["eagle"]), init=init)


def head_from_state(config: dict, state: dict[str, torch.Tensor]) -> EagleHead:
    """The head a checkpoint describes, holding `state`'s tensors themselves (no copy): built on the
    meta device, so no weight is allocated or initialised first (a hot swap's load path)."""
    with torch.device("meta"):
        head = head_from_config(config)
    head.load_state_dict(state, assign=True)  # strict: every weight present, shapes checked
    cfg = head.policy_cfg  # non-persistent buffers are not in a checkpoint: rebuild them (tables are cached)
    head.rotary = Rotary(cfg.head_dim, 2 * cfg.max_position, cfg.rope_theta)
    leftover = [name for name, t in [*head.named_parameters(), *head.named_buffers()] if t.is_meta]
    if leftover:
        raise ValueError(f"checkpoint leaves {leftover} unset")
    return head
