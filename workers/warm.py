"""Warm drafts: the recipe `tlt drafter train --task` warm-starts a head with, and how a job starts
from one (JobSpec.warm_draft): a draft checkpoint file, or a version of another job's served store,
published to the job's own served store as version 1 before the first rollout.

A job's prompts come from workers.tasks with the job's seed; the warm start draws its own with other
seeds (TRAIN_SEED, EVAL_SEED), so it never trains on a job's exact prompts and its evaluation is held out.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from drafter.model.config import DRAFT_FORMAT, TrainConfig, cache_root, check_aux_layer_ids

WARM_TRAIN_SEED = 1_001  # the task's prompts the head trains on (a job's own seed is usually small)
WARM_EVAL_SEED = 2_002  # held-out prompts the warm start measures accepted length on
STORE_REF = re.compile(r"^store:([A-Za-z0-9_.-]{1,64}):([1-9][0-9]{0,8})$")  # "store:JOBID:VERSION"


@dataclass(frozen=True)
class WarmRecipe:
    """`tlt drafter train --task`'s defaults on a CPU: the draft `make warm-draft` builds and the checkout ships
    (deploy/drafts/). Sized for the long tail speculation serves: prompts mostly asking for detailed reasoning,
    rollouts long enough to reach past the openings, harvested with the policy in the precision workers serve it in,
    15 minutes of training in bf16 where the CPU has it natively. Measured on SmolLM2-135M, 2-core AMD EPYC
    (AVX512-BF16), 2 threads, a quiet box: 139,012 tokens harvested in 669 s (bf16, 208 tokens/s), 768 steps in the
    900 s; on 8 held-out prompts greedy accepted length 2.07 / 2.32 / 2.42 at k = 2 / 3 / 4, expected 2.12 at T=1,
    k = 4 (deploy/drafts/smollm2-135m-longtail/report.json). The recipe before (96 prompts, float32 harvest, 20,692
    tokens): 1.83 / 1.98 / 2.07 and 1.82."""

    num_prompts: int = 640  # task prompts harvested at T=1: ~140k tokens (the head learns the policy, not the prompts)
    max_new_tokens: int = 320  # per harvested rollout: the tail's responses run to 512, past the openings
    temperature: float = 1.0  # as RL samples
    num_steps: int = 1_000_000  # training micro-steps (4 packed rows of 256 pairs each): a limit, the budget binds
    num_unroll: int = 4  # draft positions trained: the demo and `tlt bench rl` draft up to k=4
    draft_vocab_size: int = 8192  # JobSpec's default
    batch_size: int = 32  # rollouts harvested together (bf16 on 2 cores: 220 tokens/s at 16, 270 at 32 and 64)
    num_eval_prompts: int = 8  # held-out prompts for the accepted-length evaluation
    # longtail: share of the harvested and held-out prompts asking for detailed reasoning (the task's own 0.1
    # would leave the head few tokens of the tail, where speculation serves: the short answers are a line)
    tail_fraction: float = 0.75
    train_seconds: float | None = 900.0  # a training budget in seconds (the rate anneals to it); None: num_steps only
    position_loss: str = "reach"  # how the unrolled positions weigh (TrainConfig's)
    # bf16 autocast in training: None where the device has native bf16 (drafter.model.linear.fast_bf16: 1.5x a
    # float32 step on an AVX512-BF16 CPU), never elsewhere (emulated, slower than float32)
    bf16_autocast: bool | None = None
    # the policy's precision while harvesting (JobSpec.policy_dtype's values): "auto", as `make demo` and `tlt bench
    # rl` serve it, so the head trains on the hidden states it is served with; bf16 harvests ~3x float32 on a CPU
    # with native bf16
    policy_dtype: str = "auto"

    def train_config(self) -> TrainConfig:
        """The trainer's settings: TrainConfig's defaults but for the recipe's; the cosine spans num_steps, or the
        time budget where there is one."""
        return TrainConfig(total_steps=self.num_steps, num_unroll=self.num_unroll, position_loss=self.position_loss,
                           anneal_to_budget=self.train_seconds is not None, bf16_autocast=self.bf16_autocast)

    def key(self, model: str, task: str) -> str:
        """Cache key: the model, the task, every field of the recipe and the draft layout (DRAFT_FORMAT: a
        draft cached in another layout is never found as one of this layout)."""
        blob = json.dumps([model, task, asdict(self), WARM_TRAIN_SEED, WARM_EVAL_SEED, DRAFT_FORMAT], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# The GPU's recipe: a warm start within 5 minutes (issue 39). 3,072 task prompts of up to 192 tokens at batch 256,
# sampled at T=1: about 500k generated tokens (an H200 harvested 9.8k tokens/s at batch 128, where short answers
# leave the batch's last steps to a few rows; 15k is issue 39's goal; about 3 GB of bf16 features in host memory);
# 150 s of training in micro-steps of GPU_TOKENS_PER_STEP pairs on every position inference drafts (k up to 6),
# weighed by reach; 32 held-out prompts for the draft temperature and the accepted length. Not measured whole on a
# GPU yet (`tlt bench gpu` (b) runs it with its own prompt counts).
GPU_RECIPE = WarmRecipe(num_prompts=3072, max_new_tokens=192, num_steps=1_000_000, num_unroll=6, batch_size=256,
                        num_eval_prompts=32, train_seconds=150.0, position_loss="reach", bf16_autocast=False)


def default_recipe(device: str) -> WarmRecipe:
    """`tlt drafter train --task`'s defaults on `device`: GPU_RECIPE on CUDA, WarmRecipe() elsewhere."""
    return GPU_RECIPE if str(device).startswith("cuda") else WarmRecipe()


def warm_cache_dir(model: str, task: str, recipe: WarmRecipe) -> Path:
    """Where a warm draft built by `recipe` for `model` on `task` is cached: under $TLT_CACHE_DIR (the
    models' cache root, drafter.model.loading.default_cache_dir), keyed by all three."""
    return cache_root() / "drafters" / f"{task}-{recipe.key(model, task)}"


WARM_REPORT = "report.json"  # beside a cached warm draft: what building it measured; its presence marks it whole
# warm drafts that come with the checkout (not with the installed package: a bundle stays small), one folder per
# model and task, each a draft file and its WARM_REPORT: what a fresh clone's `tlt demo` starts its TLT-on job from
SHIPPED_DRAFTS = Path(__file__).resolve().parents[1] / "deploy" / "drafts"


def shipped_warm_draft(model: str, task: str) -> Path | None:
    """The warm draft the checkout ships for `model` on `task` (SHIPPED_DRAFTS/MODEL-TASK, with its WARM_REPORT),
    None when it ships none (or runs from an installed package, which has no deploy/)."""
    out = SHIPPED_DRAFTS / f"{model}-{task}"
    path = out / "draft-v000001.safetensors"
    return path if path.is_file() and (out / WARM_REPORT).is_file() else None


def ship_warm_draft(model: str, task: str) -> Path:
    """Copy the warm draft cached for WarmRecipe() (`make warm-draft`'s) to SHIPPED_DRAFTS as the checkout's
    (`make ship-draft`): its weights in bf16 (half the bytes in git; load_warm_draft serves them in float32), its
    report with the recipe and where, when and from which commit it was shipped (workers.results.provenance).
    Returns the shipped draft's path."""
    import torch

    from drafter.model.loading import cast_state
    from drafter.train.checkpoint import load_draft, save_draft
    from workers.results import provenance

    src = warm_cache_dir(model, task, WarmRecipe())
    if not (src / WARM_REPORT).is_file():
        raise ValueError(f"no warm draft cached in {src}: build it first (`make warm-draft` or `tlt drafter train "
                         f"--task {task}`)")
    state, meta = load_draft(src / "draft-v000001.safetensors")
    meta.extra = {**meta.extra, "stored_dtype": "bfloat16"}
    out = SHIPPED_DRAFTS / f"{model}-{task}"
    out.mkdir(parents=True, exist_ok=True)
    save_draft(out / "draft-v000001.safetensors",
               cast_state(state, torch.bfloat16), meta)
    report = json.loads((src / WARM_REPORT).read_text())
    (out / WARM_REPORT).write_text(json.dumps({**report, "recipe": asdict(WarmRecipe()), "shipped": provenance()},
                                              indent=1))
    return out / "draft-v000001.safetensors"


def ensure_warm_draft(model: str, task: str, device: str = "cpu", recipe: WarmRecipe | None = None,
                      is_build_allowed: bool = True) -> str | None:
    """The path of the warm draft `recipe` (default WarmRecipe()) builds for `model` on `task`: the cached one
    (warm_cache_dir, with its WARM_REPORT) or, if none is and is_build_allowed, one built here now on `device`
    (a GPU: about 2 minutes for SmolLM2 at the default recipe; 15 on a 2-core CPU). None when none is cached and
    building is not allowed."""
    recipe = recipe or WarmRecipe()
    out = warm_cache_dir(model, task, recipe)
    path = out / "draft-v000001.safetensors"
    if path.is_file() and (out / WARM_REPORT).is_file():
        return str(path)
    if not is_build_allowed:
        return None
    report = build_warm_draft(model, task, out, device, recipe)
    (out / WARM_REPORT).write_text(json.dumps(report, indent=1))  # last: its presence marks a finished build
    return str(path)


def build_warm_draft(model: str, task: str, out: str | Path, device: str, recipe: WarmRecipe,
                     max_seconds: float | None = None, harvest_file: str | Path | None = None) -> dict:
    """Load `model` on `device` in recipe.policy_dtype's precision there and warm-start a draft by `recipe`
    (warm_start_by_recipe), saved as out/draft-v000001.safetensors; returns the warm start's report
    (drafter.train.warmstart.WarmStartReport's fields, with the model, task, device and policy_dtype). The one recipe
    of `tlt drafter train --task`, `tlt demo`'s warm draft (through that command), `tlt bench rl`'s and `tlt bench
    gpu`'s. max_seconds: a training time budget besides the recipe's; harvest_file: drafter.train.warmstart's (the
    rollouts kept there, or read from it when it exists)."""
    from drafter.model.loading import load_model
    from workers.device import policy_dtype

    task_prompts(task, WARM_TRAIN_SEED, 1)  # a task that does not exist: before the load
    loaded = load_model(model, dtype=policy_dtype(recipe.policy_dtype, device), device=device)
    return warm_start_by_recipe(loaded, task, out, recipe, max_seconds, harvest_file)


def warm_start_by_recipe(loaded, task: str, out: str | Path, recipe: WarmRecipe, max_seconds: float | None = None,
                         harvest_file: str | Path | None = None, extra_prompts: tuple[str, ...] = (),
                         progress=None) -> dict:
    """Harvest the task's prompts (TRAIN_SEED) and `extra_prompts` (texts: the GPU bench adds its templated ones,
    for diversity) with `loaded` (drafter.model.loading.LoadedModel), sampled at recipe.temperature; train a head
    by `recipe` on its device; measure it on held-out task prompts (EVAL_SEED; none if recipe.num_eval_prompts is
    0) and save it in `out`. Returns build_warm_draft's report."""
    from drafter.model.loading import encode_text
    from drafter.train.warmstart import HarvestConfig, stderr_progress, warm_start

    texts = [task_prompts(task, seed, num, recipe.tail_fraction) if num else []
             for seed, num in ((WARM_TRAIN_SEED, recipe.num_prompts), (WARM_EVAL_SEED, recipe.num_eval_prompts))]
    vocab = loaded.model.cfg.vocab_size
    prompts, eval_prompts = ([encode_text(loaded.tokenizer, t, vocab) for t in group]
                             for group in (texts[0] + list(extra_prompts), texts[1]))
    budgets = [b for b in (max_seconds, recipe.train_seconds) if b is not None]
    _, report = warm_start(loaded.model, loaded.tokenizer, prompts, out, train_cfg=recipe.train_config(),
                           harvest_cfg=HarvestConfig(max_new_tokens=recipe.max_new_tokens,
                                                     batch_size=recipe.batch_size, temperature=recipe.temperature,
                                                     top_p=1.0),
                           max_steps=recipe.num_steps, max_seconds=min(budgets) if budgets else None,
                           draft_vocab_size=recipe.draft_vocab_size, eval_prompts=eval_prompts or None,
                           harvest_file=harvest_file, progress=progress or stderr_progress)
    return {"model": loaded.name, "task": task, "device": str(loaded.model.device),
            "policy_dtype": str(loaded.model.dtype).removeprefix("torch."), **asdict(report)}


def task_prompts(task: str, seed: int, num: int, tail_fraction: float | None = None) -> list[str]:
    """`num` prompt texts of the built-in task named `task` (workers.tasks), drawn with `seed`; for the
    longtail task, `tail_fraction` (if given) is the share asking for detailed reasoning."""
    from workers.tasks import make_task

    options = {"long_fraction": tail_fraction} if task == "longtail" and tail_fraction is not None else {}
    try:
        return [p.prompt for p in make_task(task, seed, **options).sample(num)]
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


def parse_store_ref(ref: str) -> tuple[str, int] | None:
    """("JOBID", VERSION) for "store:JOBID:VERSION", None for anything else (a path)."""
    m = STORE_REF.match(ref)
    return (m.group(1), int(m.group(2))) if m else None


def check_fits(head_config: dict, policy_cfg, source: str) -> None:
    """ValueError naming warm_draft unless a draft with `head_config` can serve a policy with `policy_cfg`
    (a drafter.model.config.ModelConfig): the same hidden size and vocabulary (the head shares the policy's
    embedding, and its LM head scores the policy's tokens), this project's draft layout (DRAFT_FORMAT), a draft
    vocabulary within the policy's, and aux layers the policy has."""
    try:
        theirs = head_config["policy"]
        eagle = head_config["eagle"]
        hidden, vocab = int(theirs["hidden_size"]), int(theirs["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"warm_draft {source}: its head_config does not describe a head ({exc!r})") from None
    if hidden != policy_cfg.hidden_size or vocab != policy_cfg.vocab_size:
        raise ValueError(f"warm_draft {source} does not fit the policy: the head was trained for hidden size "
                         f"{hidden} and vocabulary {vocab}, the policy has {policy_cfg.hidden_size} and "
                         f"{policy_cfg.vocab_size}")
    if head_config.get("format") != DRAFT_FORMAT:
        raise ValueError(f"warm_draft {source} is a draft of another layout ({head_config.get('format')!r}, not "
                         f"{DRAFT_FORMAT!r}: an EAGLE-1-style head from before EAGLE-3); train a new one")
    num_draft = eagle.get("draft_vocab_size") or vocab
    if not 0 < num_draft <= policy_cfg.vocab_size:
        raise ValueError(f"warm_draft {source}: draft vocabulary {num_draft} is outside the policy's {vocab}")
    if eagle.get("aux_layer_ids") is not None:
        try:
            check_aux_layer_ids(eagle["aux_layer_ids"], policy_cfg.num_layers)
        except ValueError as exc:
            raise ValueError(f"warm_draft {source}: {exc}") from None


def load_warm_draft(ref: str, redis, store_dir: str | Path, policy_cfg):
    """The weights and meta of `ref` (a draft file, or "store:JOBID:VERSION"), checksum-checked and
    checked to fit `policy_cfg`. ValueError naming warm_draft for anything that does not load or fit."""
    import torch

    from drafter.model.loading import cast_state
    from drafter.train.checkpoint import load_draft
    from workers.store import job_stores

    parsed = parse_store_ref(ref)
    if parsed is None and not Path(ref).is_file():
        raise ValueError(f"warm_draft: no such file {ref}")
    try:
        if parsed is not None:
            job_id, version = parsed
            state, meta = job_stores(redis, store_dir, job_id)[0].load(version)
        else:
            state, meta = load_draft(ref)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError; so is a version not in the index
        raise ValueError(f"warm_draft {ref}: {exc}") from None
    check_fits(meta.head_config, policy_cfg, ref)
    # float32, as a job's drafts are trained and served (a shipped draft is stored in bf16, half the bytes)
    return cast_state(state, torch.float32), meta


def publish_warm_draft(ref: str, served, redis, store_dir: str | Path, policy_cfg, draft_k: int) -> int:
    """Publish `ref` to a job's served store (DraftStore) as its first version; returns the version.
    The meta keeps the draft's head config and lineage; extra["warm_draft"] names where it came from, and
    extra["accepted_length"] (the published score a swap guard compares with) is the lower of the
    warm start's measurements: greedy at `draft_k`, expected at T=1 (the draft keeps any it had already)."""
    state, meta = load_warm_draft(ref, redis, store_dir, policy_cfg)
    measured = [v for v in ((meta.extra.get("acceptance") or {}).get(str(draft_k)),
                            meta.extra.get("expected_accepted_length_t1")) if isinstance(v, (int, float))]
    meta.parent_version, meta.policy_version = 0, 0
    meta.extra = {**meta.extra, "warm_draft": ref}
    if measured and "accepted_length" not in meta.extra:
        meta.extra["accepted_length"] = min(measured)
    return served.publish(state, meta)
