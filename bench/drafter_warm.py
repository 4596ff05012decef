"""`tlt bench drafter`'s warm-started EAGLE-3 head, cached under $TLT_CACHE_DIR/drafters/ (keyed by model and
settings), its harvest under $TLT_CACHE_DIR/harvests/. Its own module so that `tlt bench drafter-history` takes the
same head by default while `tlt bench drafter` runs that bench's arms as its part (h), with no import circle."""

from __future__ import annotations

import hashlib
import json
import sys

from bench.prompts import synthetic_prompts
from drafter.draft.head import head_from_state
from drafter.model.config import DRAFT_FORMAT, TrainConfig
from drafter.model.loading import default_cache_dir, encode_prompt
from drafter.train.checkpoint import load_draft
from drafter.train.warmstart import HarvestConfig, warm_start


def log(msg: str) -> None:
    print(f"[bench drafter] {msg}", file=sys.stderr, flush=True)


def warm_train_config(max_steps: int, num_unroll: int) -> TrainConfig:
    """The CPU warm start's recipe: TrainConfig's defaults, with the cosine horizon at the step budget and
    `num_unroll` trained draft positions (4: what docs/bench/drafter.json measured; on 2 cores each extra position
    costs a sixth of a step) weighed by unroll_decay, as that draft was (its cache key has no position_loss)."""
    return TrainConfig(total_steps=max_steps, num_unroll=num_unroll, position_loss="decay", anneal_to_budget=False,
                       bf16_autocast=False)


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


def warm_drafter(loaded, num_prompts: int, max_steps: int, draft_vocab: int, num_unroll: int = 4):
    cache = default_cache_dir().parent
    # keyed by the draft layout too (DRAFT_FORMAT): a draft or harvest of another layout is never reused
    out = cache / "drafters" / _key(loaded.name, num_prompts, max_steps, draft_vocab, num_unroll, 4, DRAFT_FORMAT)
    # the harvest does not depend on the training recipe: kept apart, a new recipe reuses it
    harvest_file = cache / "harvests" / (f"{_key(loaded.name, num_prompts, 1, vars(HarvestConfig()), DRAFT_FORMAT)}"
                                         ".safetensors")
    path = out / "draft-v000001.safetensors"
    if path.is_file():
        state, meta = load_draft(path, loaded.model.device)  # on the policy's device, as warm_start leaves its head
        head = head_from_state(meta.head_config, state).to(loaded.model.dtype)
        log(f"reusing the warm-started drafter {path}")
        return head.eval().requires_grad_(False), {"cached": True, "path": str(path), "train_steps": meta.num_steps}
    log(f"warm start: {num_prompts} prompts, {max_steps} training steps (cached afterwards in {out})")
    prompts = [encode_prompt(loaded.tokenizer, t) for t in synthetic_prompts(num_prompts, seed=1)]
    head, rep = warm_start(loaded.model, loaded.tokenizer, prompts, out, max_steps=max_steps,
                           train_cfg=warm_train_config(max_steps, num_unroll), draft_vocab_size=draft_vocab,
                           progress=log, harvest_file=harvest_file)
    return head, {"cached": False, "path": rep.path, "train_steps": rep.train_steps,
                  "harvested_tokens": rep.num_harvested_tokens, "harvest_s": round(rep.harvest_seconds, 1),
                  "train_s": round(rep.train_seconds, 1), "train_tokens_per_s": round(rep.train_tokens_per_s, 1)}
