"""The draft head, in the standard EAGLE-3 layout (vLLM's and SGLang's `LlamaForCausalLMEagle3`).

The head lags the policy by one position. At position i it reads the hidden states of three policy
layers (low, middle, high: EagleConfig.aux_layer_ids) fused by `fc` (3D -> D), and the embedding of the
token that followed, t_{i+1}; one decoder layer (`midlayer`) whose q/k/v read
cat(input_layernorm(embedding), hidden_norm(hidden)) (2D) and whose residual stream starts from the
hidden itself; then a final `norm` and the head's own `lm_head` over its draft vocabulary give the
distribution of t_{i+2}. Drafting a further token feeds the layer's output back as the next position's
hidden, before the final norm and without `fc` (as vLLM's and SGLang's EAGLE-3 proposers do). The token
embedding is the policy's (not stored with the head); the LM head is the head's own ([V', D], initialised
from the policy's rows of the draft vocabulary by new_head). drafter.draft.eagle3 writes and reads the standard
checkpoint directory.

Also the head's factories: a fresh head (new_head), the config a checkpoint records (head_config)
and the head a checkpoint describes (head_from_config, head_from_state).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from drafter.model.causal_lm import MLP, Attention, CausalLM, KVCache, RMSNorm, Rotary, tree_inputs
from drafter.model.config import DRAFT_FORMAT, NUM_AUX_LAYERS, ModelConfig, check_aux_layer_ids, default_aux_layer_ids
from drafter.model.linear import Linear
from drafter.train.buffer import RolloutBuffer


@dataclass
class EagleConfig:
    # The policy layers whose hidden states the head fuses, as vLLM numbers EAGLE-3's aux states (id i: the
    # residual stream entering layer i; drafter.model.config.default_aux_layer_ids). None: the policy's default,
    # resolved (and recorded) when the head is built.
    aux_layer_ids: tuple[int, ...] | None = None
    # Score only this many tokens (the most frequent in rollouts, as EAGLE-3 does): the LM head is
    # a fifth of SmolLM2's weights, and each draft step would otherwise pay for all of it.
    draft_vocab_size: int | None = None  # None = the policy's full vocabulary
    init_seed: int = 0
    # Sampled rows draft from the job's sampling distribution over logits / draft_temperature (0: the
    # argmax). Rejection sampling stays exact for any draft distribution q; what it accepts against the
    # target p, sum min(p, q), is highest for q = p, so a head whose q is flatter than p accepts more
    # with a sharper q. Which one wins is measured: calibrate_draft_temperature (drafter.train.evaluate) on
    # held-out rollouts. SmolLM2's warm-started head scored best at 1.0 (docs/benchmarks.md).
    draft_temperature: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.draft_temperature, (int, float)) or not 0 <= self.draft_temperature <= 10:
            raise ValueError(f"draft_temperature must be in [0, 10], got {self.draft_temperature!r}")
        if self.aux_layer_ids is not None:  # a list from JSON: a tuple, checked against the policy later
            self.aux_layer_ids = tuple(self.aux_layer_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        return d


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (`midlayer`): attention over cat(input_layernorm(embedding),
    hidden_norm(hidden)) (2D in, no q/k/v bias), the residual stream starting from the un-normed hidden,
    then the policy's MLP shape. Module names follow the standard checkpoint's (q/k/v and gate/up are
    stored fused here and split on export, as vLLM fuses them on load)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.self_attn = Attention(cfg)
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.self_attn.qkv_proj = Linear(2 * d, q_dim + 2 * kv_dim, bias=False)  # reads [embedding; hidden]
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(cfg)

    def attn_input(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """(B, T, D) hidden and embeddings -> (B, T, 2D): what q/k/v read."""
        return torch.cat([self.input_layernorm(token_embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention (its output after o_proj) and the MLP: the layer's output."""
        x = hidden + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, hidden, token_embeds, rope, cache, slots, mask, num_slots) -> torch.Tensor:
        attn = self.self_attn(self.attn_input(hidden, token_embeds), rope, cache, 0, slots, mask, num_slots)
        return self.finish(hidden, attn)


class EagleHead(nn.Module):
    def __init__(self, policy_cfg: ModelConfig, cfg: EagleConfig | None = None, init: bool = True) -> None:
        """init=False leaves the weights uninitialised, for a head about to load a checkpoint (a
        hot swap: random init is most of the cost of building a SmolLM2-size head)."""
        super().__init__()
        self.cfg = cfg or EagleConfig()
        self.policy_cfg = policy_cfg
        ids = self.cfg.aux_layer_ids
        self.cfg.aux_layer_ids = check_aux_layer_ids(default_aux_layer_ids(policy_cfg.num_layers) if ids is None
                                                     else ids, policy_cfg.num_layers)
        d = policy_cfg.hidden_size
        num_draft = self.cfg.draft_vocab_size or policy_cfg.vocab_size
        if not 0 < num_draft <= policy_cfg.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {policy_cfg.vocab_size}], got {num_draft}")
        self.fc = Linear(NUM_AUX_LAYERS * d, d, bias=False)  # fuses the three aux states
        self.midlayer = Eagle3Layer(policy_cfg)
        self.norm = RMSNorm(d, policy_cfg.rms_norm_eps)
        self.lm_head = Linear(d, num_draft, bias=False)  # the draft vocabulary's rows (new_head: the policy's)
        # drafting runs up to k positions past the policy's context: give the table room for it
        self.rotary = Rotary(policy_cfg.head_dim, 2 * policy_cfg.max_position, policy_cfg.rope_theta)
        if init:
            gen = torch.Generator().manual_seed(self.cfg.init_seed)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02, generator=gen)
        # policy token id of each draft-vocabulary entry; set_vocab picks them from rollouts
        self.register_buffer("vocab_ids", torch.arange(num_draft, dtype=torch.long))

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.aux_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of a recorded feature row (drafter.model.causal_lm.draft_features): the aux states, then the final
        hidden."""
        return (NUM_AUX_LAYERS + 1) * self.policy_cfg.hidden_size

    def set_vocab(self, token_counts: torch.Tensor, always: tuple[int, ...] = ()) -> None:
        """Keep the most frequent tokens (counts: (V,) over the policy vocabulary) plus `always` (EOS). The LM
        head's rows then belong to other tokens: new_head sets them from the policy's (init_lm_head)."""
        n = self.vocab_ids.numel()
        counts = token_counts.double().clone()
        counts[list(always)] = float("inf")
        ids = counts.topk(n).indices.sort().values
        self.vocab_ids.copy_(ids)  # onto the head's device

    @torch.no_grad()
    def init_lm_head(self, policy: CausalLM) -> None:
        """The LM head's rows := the policy's for the draft vocabulary (where EAGLE-3 training starts)."""
        self.lm_head.weight.copy_(draft_lm_weight(self, policy).to(self.lm_head.weight.dtype))

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """(..., >= 3D) recorded features (drafter.model.causal_lm.draft_features) -> (..., D): fc over the aux states,
        the hidden the head takes at a position the policy has verified."""
        return self.fc(feats[..., : NUM_AUX_LAYERS * self.policy_cfg.hidden_size])

    def policy_hidden(self, feats: torch.Tensor) -> torch.Tensor:
        """(..., 4D) recorded features -> (..., D): the policy's final-norm hidden state, a training target
        (the policy's next-token distribution is its LM head over it)."""
        return feats[..., NUM_AUX_LAYERS * self.policy_cfg.hidden_size :]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) layer outputs (before the final norm) -> (..., V') logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.policy_cfg
        return KVCache(1, batch_size, max_len, c.num_kv_heads, c.head_dim, dtype, device)

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """hidden, token_embeds: (B, T, D): fuse(features) at verified positions, or the head's own previous
        output; positions (B, T). Returns the layer's output (B, T, D), before the final norm: what `logits`
        scores and what the next draft position takes as its hidden. tree: (slots, mask) of a draft tree's
        nodes, as in CausalLM.forward."""
        rope = self.rotary(positions, hidden.dtype)
        slots, mask, num_slots = tree_inputs(positions, cache, tree)
        return self.midlayer(hidden, token_embeds, rope, cache, slots, mask, num_slots)


def draft_lm_weight(head: EagleHead, policy: CausalLM) -> torch.Tensor:
    """The policy's LM head restricted to the head's draft vocabulary, (V', D): the rows the head's own LM
    head starts from, and what training scores the policy's (target) distribution with."""
    return policy.lm_head.weight[head.vocab_ids.to(policy.lm_head.weight.device)]


def token_counts(buffer: RolloutBuffer, vocab_size: int) -> torch.Tensor:
    """(V,) how often each policy token occurs in the buffer's rollouts (on the CPU, where they are)."""
    counts = torch.zeros(vocab_size, dtype=torch.long, device="cpu")
    for r in buffer.rollouts:
        counts += torch.bincount(r.tokens.long(), minlength=vocab_size)
    return counts


def new_head(policy: CausalLM, buffer: RolloutBuffer | None, draft_vocab_size: int | None, seed: int = 0) -> EagleHead:
    """A fresh head on the policy's device, in its dtype; with a buffer, its draft vocabulary is the buffer's
    most frequent tokens. Its LM head starts as the policy's rows for that vocabulary."""
    if draft_vocab_size is not None and draft_vocab_size >= policy.cfg.vocab_size:
        draft_vocab_size = None
    # initialised on the CPU (its seeded generator is a CPU one: the same head on every device), then moved
    head = EagleHead(policy.cfg, EagleConfig(draft_vocab_size=draft_vocab_size, init_seed=seed))
    head = head.to(device=policy.device, dtype=policy.dtype)
    if buffer is not None and draft_vocab_size is not None:
        head.set_vocab(token_counts(buffer, policy.cfg.vocab_size), always=policy.cfg.eos_token_ids)
    head.init_lm_head(policy)
    return head


def head_config(head: EagleHead) -> dict:
    """What a checkpoint records to rebuild the head (DraftMeta.head_config): the layout's name, the
    policy's config and the head's."""
    return {"format": DRAFT_FORMAT, "policy": head.policy_cfg.to_dict(), "eagle": head.cfg.to_dict()}


def check_head_config(config: dict) -> tuple[ModelConfig, EagleConfig]:
    """The policy and head configs a checkpoint's head_config describes; ValueError for anything else, and
    for a draft of another layout (the EAGLE-1-style head this project used before the EAGLE-3 one)."""
    if not isinstance(config, dict):
        raise ValueError(f"head_config must be an object, got {type(config).__name__}")
    if config.get("format") != DRAFT_FORMAT:
        raise ValueError(f"head_config format is {config.get('format')!r}, expected {DRAFT_FORMAT!r}: the draft "
                         "was saved in another layout (an EAGLE-1-style head, before EAGLE-3) and cannot be loaded; "
                         "train a new one")
    try:
        return ModelConfig.from_dict(config["policy"]), EagleConfig(**config["eagle"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"head_config does not describe a head: {exc}") from None


def head_from_config(config: dict, init: bool = False) -> EagleHead:
    """The head a checkpoint's head_config describes; its weights are left for load_state_dict
    unless init (then: the seeded initialisation a new head gets)."""
    policy_cfg, cfg = check_head_config(config)
    return EagleHead(policy_cfg, cfg, init=init)


def head_from_state(config: dict, state: dict[str, torch.Tensor]) -> EagleHead:
    """The head a checkpoint describes, holding `state`'s tensors themselves (no copy): built on the
    meta device, so no weight is allocated or initialised first (a hot swap's load path). ValueError
    when the checkpoint does not fit the head (another layout, missing or misshapen tensors)."""
    with torch.device("meta"):
        head = head_from_config(config)
    try:
        head.load_state_dict(state, assign=True)  # strict: every weight present, shapes checked
    except RuntimeError as exc:
        raise ValueError(f"the checkpoint's tensors do not fit its head: {exc}") from None
    cfg = head.policy_cfg  # non-persistent buffers are not in a checkpoint: rebuild them (tables are cached),
    # on the device of the weights they serve beside
    head.rotary = Rotary(cfg.head_dim, 2 * cfg.max_position, cfg.rope_theta).to(head.fc.weight.device)
    leftover = [name for name, t in [*head.named_parameters(), *head.named_buffers()] if t.is_meta]
    if leftover:
        raise ValueError(f"checkpoint leaves {leftover} unset")
    return head
