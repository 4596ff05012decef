"""GPU profiles from published figures: an 8B dense model (Qwen3-8B, as NeMo RL's measured run) and a
235B-class MoE (Qwen3-235B-A22B on 8 GPUs per engine), both on GB200-class GPUs.

Decode cost: the roofline of scheduler/simulate/cost.py with the GPU's datasheet bandwidth and flops, the
models' published shapes, and two efficiencies: MBU 0.8 (SGLang's Llama-3.1-8B decodes 158 tokens/s at
batch 1 on one H100: 6.3 ms per token, i.e. its 16 GB at 80% of 3.35 TB/s plus 0.3 ms) and MFU 0.5
(assumption). Response lengths: one capped lognormal per response, half of its log-variance between prompts
(assumption), fitted so that the simulated per-request generation times of a plain rollout have verl
#7412's shape (min 18.7 s, mean 266.6 s, max 539.5 s: min/max and mean/max). The learner's phases are set
from a published share of the step at a reference scale (8B: NeMo RL's 100 s generation in a 151.2 s step
at 32 GPUs; 235B: Seer's 63% rollout share for its 72B model, taken at 256 GPUs) and held constant as the
cluster grows (weak scaling: prompts per GPU fixed).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import numpy as np

from scheduler.simulate.cost import Forward, StepCost, rate_for_length
from scheduler.simulate.lengths import LengthKind, LengthModel, fit
from scheduler.simulate.profiles import Acceptance, Phases, Profile, Workload
from scheduler.simulate.worker import Timeline
from workers.engines import Speculation

GB200_BANDWIDTH = 8.0e12  # bytes/s HBM3e per B200 GPU (GB200 NVL72 datasheet)
GB200_BF16 = 2.5e15  # dense BF16 flop/s per B200 GPU (GB200 NVL72 datasheet)
MBU, MFU = 0.8, 0.5
STEP_OVERHEAD_S = 0.3e-3  # per forward: launch and sampling (the 0.3 ms of SGLang's batch-1 figure)
SPEC_OVERHEAD_S = 0.3e-3  # per speculative step: rejection sampling and draft bookkeeping (assumption)
ALL_TO_ALL_S = 25e-6  # one MoE all-to-all on NVLink (assumption); two per layer per forward
VERL_7412 = {"min_s": 18.7, "mean_s": 266.6, "max_s": 539.5}  # per-request generation time
VERL_BATCH = 512  # requests behind verl #7412's min (not stated there: assumption)
NEMO_8B = {"gen_s": 100.0, "gen_spec_s": 56.6, "step_s": 151.2, "step_spec_s": 107.5, "accepted_length": 2.47,
           "k": 3, "num_gpus": 32}  # NeMo RL, arXiv 2604.26779: Qwen3-8B, RL-Think, EAGLE-3, 32 GB200 GPUs
SEER_ROLLOUT_SHARE = {"moonlight": 0.84, "72b": 0.63}  # Seer: rollout's share of an iteration
SEER_LAST10_SHARE = 0.5  # Seer: the last 10% of requests take up to 50% of the rollout time
VERL_UTILISATION = (0.715, 0.746)  # verl partial-rollout recipe: baseline GPU utilisation
GROUP_SHARE = 0.5  # assumption: half a response length's log-variance lies between prompts


def _forward(params: float, layers: int, kv_heads: int, q_heads: int, head_dim: int, gpus: int = 1,
             expert_params: float = 0.0, expert_fraction: float = 0.0, overhead_s: float = STEP_OVERHEAD_S
             ) -> Forward:
    """A bf16 transformer's forward on `gpus` GPUs (weights, KV cache and flops split evenly)."""
    active = params + expert_params * expert_fraction
    return Forward(overhead_s=overhead_s, bandwidth=GB200_BANDWIDTH * MBU, compute=GB200_BF16 * MFU,
                   dense_bytes=2 * params / gpus, expert_bytes=2 * expert_params / gpus,
                   expert_fraction=expert_fraction, kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2 / gpus,
                   flops_per_token=2 * active / gpus, attn_flops_per_ctx=4 * layers * q_heads * head_dim / gpus)


# Qwen3-8B: 36 layers, 32 query / 8 KV heads of 128; 7.6e9 matmul parameters (LM head included)
QWEN3_8B = _forward(7.6e9, 36, 8, 32, 128)
# its EAGLE-3 head: fc (3D -> D), one decoder layer, a 32k draft vocabulary: about 0.4e9 parameters
EAGLE3_8B = _forward(0.4e9, 1, 8, 32, 128)
# Qwen3-235B-A22B on 8 GPUs: 94 layers, 64 query / 4 KV heads of 128, 128 experts of which 8 route per
# token; 8.0e9 dense parameters (attention, embeddings, LM head) and 227e9 in experts; two all-to-alls a layer
QWEN3_235B = _forward(8.0e9, 94, 4, 64, 128, gpus=8, expert_params=227e9, expert_fraction=8 / 128,
                      overhead_s=STEP_OVERHEAD_S + 2 * 94 * ALL_TO_ALL_S)
EAGLE3_235B = _forward(0.4e9, 1, 4, 64, 128, gpus=8)


def request_seconds(profile: Profile, num_requests: int, seed: int = 0) -> np.ndarray:
    """Per-request generation seconds (rollout start to finish) of a plain rollout of num_requests requests."""
    wl = profile.workload
    per_worker = wl.prompts_per_worker * wl.group_size
    num_workers = max(1, num_requests // per_worker)
    groups = wl.lengths.sample_groups(random.Random(seed), wl.prompts_per_worker * num_workers, wl.group_size)
    out = []
    for w in range(num_workers):
        share = [n for g in groups[w::num_workers] for n in g]
        tl = Timeline(share, wl.prompt_tokens, profile.cost, wl.draft_k, Speculation.OFF)
        tl.build(tl.prefill_s(), 0.0, 0.0)
        out.append(tl.finish)
    return np.concatenate(out)


def fit_lengths(profile: Profile) -> tuple[LengthModel, dict[str, float], dict[str, float]]:
    cap = profile.workload.lengths.max_tokens
    targets = {"min_over_max": VERL_7412["min_s"] / VERL_7412["max_s"],
               "mean_over_max": VERL_7412["mean_s"] / VERL_7412["max_s"]}

    def build(x) -> LengthModel:
        return LengthModel((LengthKind(1.0, math.exp(x[0]), math.exp(x[1])),), cap, group_share=GROUP_SHARE)

    def figures(m: LengthModel) -> dict[str, float]:
        t = request_seconds(replace(profile, workload=replace(profile.workload, lengths=m)), VERL_BATCH)
        return {"min_over_max": float(t.min() / t.max()), "mean_over_max": float(t.mean() / t.max())}

    return fit(build, figures, targets, [math.log(0.3 * cap), math.log(1.0)])


def _base(name: str, description: str, target: Forward, draft: Forward, cap: int, prompts_per_worker: int,
          gpus_per_worker: int, sources: dict[str, str]) -> Profile:
    warm = rate_for_length(NEMO_8B["k"], NEMO_8B["accepted_length"])
    lengths = LengthModel((LengthKind(1.0, 0.3 * cap, 1.0),), cap, group_share=GROUP_SHARE)
    return Profile(
        name=name, description=description,
        workload=Workload(lengths=lengths, prompts_per_worker=prompts_per_worker, group_size=16,
                          prompt_tokens=512.0, draft_k=4, gpus_per_worker=gpus_per_worker),
        cost=StepCost(target, draft, SPEC_OVERHEAD_S),
        acceptance=Acceptance(min_rate=0.1, max_rate=0.8, warm_rate=warm, train_tau_s=1800.0, drift_retain=0.97,
                              train_steps_per_s=4.0, score_noise=0.03),
        phases=Phases(sync_s=0.0, learner_s=(1.0,), tick_s=0.5, dispatch_s=0.06, preempt_s=0.3, lease_setup_s=2.0,
                      copy_publish_s=2.0, scoring_s=15.0, publish_s=3.0, swap_s=1.0),
        sources={
            "cost": "roofline: GB200 8 TB/s, 2.5 PF bf16; MBU 0.8 (SGLang Llama-3.1-8B, 158 tok/s at batch 1 on "
                    "H100), MFU 0.5 (assumption); the model's published shape; KV read once per forward",
            "workload.lengths": "capped lognormal fitted to verl #7412's per-request time min/mean/max (18.7 / "
                                f"266.6 / 539.5 s) over {VERL_BATCH} requests (assumption); half its log-variance "
                                "between prompts (assumption)",
            "workload.group_size/prompt_tokens/draft_k": "assumptions: 16 rollouts per prompt, 512-token prompts, "
                                                         "adaptive drafts up to 4 (NeMo RL: k=3 stable, k>=5 "
                                                         "can erase the gain)",
            "acceptance.warm_rate": "NeMo RL: EAGLE-3 accepted length 2.47 at k=3 (RL-Think)",
            "acceptance.max_rate/min_rate/train_tau_s/drift_retain/train_steps_per_s": "assumptions",
            "phases": "assumptions for GPU latencies; tick 0.5 s is scheduler.settings.TICK_S",
            **sources,
        })


def _anchor(profile: Profile, num_gpus: int, rollout_share: float, seeds: int = 3) -> Profile:
    """Learner seconds that give the plain rollout `rollout_share` of the step at num_gpus GPUs."""
    from scheduler.simulate.model import simulate

    workers = max(1, num_gpus // profile.workload.gpus_per_worker)
    rollout = statistics.fmean(s.rollout_s for seed in range(seeds)
                               for s in simulate(profile, workers, "plain", seed, 1).steps)
    learner = rollout * (1 - rollout_share) / rollout_share
    return replace(profile, phases=replace(profile.phases, learner_s=(learner,)))


def gpu_8b_profile() -> Profile:
    p = _base("gpu-8b", "Qwen3-8B, one GB200 GPU per rollout worker, 8 prompts x 16 rollouts per GPU, up to 16k "
              "tokens", QWEN3_8B, EAGLE3_8B, 16384, 8, 1,
              {"phases.learner_s": f"NeMo RL at {NEMO_8B['num_gpus']} GPUs: generation 100 s of a 151.2 s step"})
    p = replace(p, workload=replace(p.workload, lengths=fit_lengths(p)[0]))
    return _anchor(p, NEMO_8B["num_gpus"], NEMO_8B["gen_s"] / NEMO_8B["step_s"])


def gpu_235b_profile() -> Profile:
    p = _base("gpu-235b", "Qwen3-235B-A22B, 8 GB200 GPUs per engine (expert parallel), 16 prompts x 16 rollouts "
              "per engine, up to 32k tokens", QWEN3_235B, EAGLE3_235B, 32768, 16, 8,
              {"phases.learner_s": "Seer: rollout 63% of an iteration (its 72B model), at 256 GPUs (assumption)"})
    p = replace(p, workload=replace(p.workload, lengths=fit_lengths(p)[0]))
    return _anchor(p, 256, SEER_ROLLOUT_SHARE["72b"])


def nemo_8b_profile(base: Profile) -> Profile:
    """NeMo RL's measured run: EAGLE-3 at k=3 every step (vLLM fixes it), its measured acceptance throughout."""
    rate = rate_for_length(NEMO_8B["k"], NEMO_8B["accepted_length"])
    return replace(base, name="nemo-rl-8b",
                   workload=replace(base.workload, draft_k=NEMO_8B["k"], speculation=Speculation.ALWAYS),
                   acceptance=replace(base.acceptance, min_rate=rate, warm_rate=rate, max_rate=rate, drift_retain=1.0))
