"""Drafter training pairs from the learner's forward, for rollout workers whose engine does not harvest them
(workers.engine.RolloutEngine.harvests_pairs: vLLM, SGLang).

Every step the driver runs the policy over every prompt + response: the no-grad pass for the old log-probs, or,
with one update per step, the GRPO update's own forward (workers.grpo). Asked for the aux layers too, that same
forward gives what the built-in engine harvests while it generates: for a rollout x_0..x_{L-1}, the features
f_0..f_{L-2} (drafter.model.causal_lm.draft_features: the three aux layers' states, then the final hidden state, 4D per
position; the prompt's positions too, as the engine's harvest keeps them), stored at once in the worker
buffer's dtype. The update runs no forward over a row whose advantage is 0 (it adds nothing to the gradient);
those rows get a features-only no-grad forward (no LM head) before the update moves the policy (`fill`).

Each worker is sent its own rollouts' pairs as one message of numpy arrays (Ray's object store; the worker maps
them without a copy), and adds them to its RolloutBuffer tagged with the policy version that generated them
(`add_pairs`, called by RolloutRunner.add_learner_pairs). At most the buffer's max_bytes are recorded per
worker: the buffer would evict the rest at once. The calls are not waited for; the next step looks at how
they ended (`PairShipments`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from drafter.model.causal_lm import CausalLM
from drafter.model.config import default_aux_layer_ids
from drafter.train.buffer import TOKEN_DTYPE, RolloutBuffer
from workers.errors import one_line

log = logging.getLogger(__name__)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # HIDDEN_DTYPES


def wanted_owners(outs: list[dict]) -> list[str | None]:
    """Per completion dict (the driver's, tagged with its "worker"), the worker that takes its pairs from the
    learner, else None (its engine harvested them, or the job trains no drafter)."""
    return [o["worker"] if o.get("learner_pairs") else None for o in outs]


class LearnerPairs:
    """One step's features for the sequences whose worker takes its pairs from the learner (workers.grpo's
    StateRecorder). `owners[b]`: sequence b's worker, or None to record nothing for it."""

    def __init__(self, policy: CausalLM, sequences: list[list[int]], prompt_lens: list[int],
                 owners: Sequence[str | None], dtype: torch.dtype, max_bytes_per_worker: int) -> None:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_NAMES)}, got {dtype}")
        cfg = policy.cfg
        # what every head of a job fuses (drafter.draft.head.new_head: EagleConfig's default), so what engines record
        self.aux_layers = default_aux_layer_ids(cfg.num_layers)
        self.aux_size = len(self.aux_layers) * cfg.hidden_size
        self.feature_size = self.aux_size + cfg.hidden_size
        self.sequences, self.prompt_lens, self.dtype = sequences, prompt_lens, dtype
        self.slots: dict[int, tuple[str, int]] = {}  # sequence -> (worker, its first row in that worker's features)
        num_rows: dict[str, int] = {}
        num_bytes: dict[str, int] = {}
        for b, (seq, wid) in enumerate(zip(sequences, owners, strict=True)):
            if wid is None or len(seq) < 2:  # a single token makes no pair (the engine's harvest skips it too)
                continue
            size = len(seq) * TOKEN_DTYPE.itemsize + (len(seq) - 1) * self.feature_size * dtype.itemsize
            if num_bytes.get(wid, 0) + size > max_bytes_per_worker:
                continue
            self.slots[b] = (wid, num_rows.get(wid, 0))
            num_rows[wid] = num_rows.get(wid, 0) + len(seq) - 1
            num_bytes[wid] = num_bytes.get(wid, 0) + size
        # on the CPU whatever the policy's device: they travel to the workers as numpy arrays (messages)
        self.features = {wid: torch.empty(n, self.feature_size, dtype=dtype, device="cpu")
                         for wid, n in num_rows.items()}
        self.recorded: set[int] = set()

    def __len__(self) -> int:
        """Sequences recorded or to record."""
        return len(self.slots)

    @property
    def missing(self) -> list[int]:
        return [b for b in self.slots if b not in self.recorded]

    def record(self, rows: Sequence[int], hidden: torch.Tensor, aux: torch.Tensor) -> None:
        """hidden (b, L, D), aux (b, L, 3D) of a causal forward over sequences `rows` (right-padded): each wanted
        sequence's first len - 1 positions, as draft_features lays them out, in this object's dtype."""
        if aux.shape[-1] != self.aux_size or hidden.shape[-1] != self.feature_size - self.aux_size:
            raise ValueError(f"states of width {aux.shape[-1]} + {hidden.shape[-1]}; the drafter's features are "
                             f"{self.aux_size} + {self.feature_size - self.aux_size}")
        with torch.no_grad():
            for i, b in enumerate(rows):
                if b not in self.slots or b in self.recorded:
                    continue
                wid, first = self.slots[b]
                n = len(self.sequences[b]) - 1
                out = self.features[wid][first : first + n]  # (n, 4D)
                out[:, : self.aux_size].copy_(aux[i, :n])  # draft_features: the aux states first...
                out[:, self.aux_size :].copy_(hidden[i, :n])  # ...then the final hidden state
                self.recorded.add(b)

    def fill(self, model: CausalLM, skip: Iterable[int] = (), micro_batch_size: int = 8) -> int:
        """Record the sequences still missing but those in `skip` (a forward still to come records them), with
        features-only no-grad forwards, longest first; returns how many."""
        skipped = set(skip)
        todo = sorted((b for b in self.missing if b not in skipped), key=lambda b: -len(self.sequences[b]))
        device = model.device
        with torch.no_grad():
            for start in range(0, len(todo), micro_batch_size):
                idx = todo[start : start + micro_batch_size]
                L = max(len(self.sequences[b]) for b in idx)
                padded = [self.sequences[b] + [0] * (L - len(self.sequences[b])) for b in idx]
                ids = torch.tensor(padded, dtype=torch.long, device=device)  # (b, L), right-padded: causal, harmless
                positions = torch.arange(L, device=device).expand(len(idx), L)  # (b, L)
                _, hidden, aux = model(ids, positions, None, logits_for="none", aux_layers=self.aux_layers)
                self.record(idx, hidden, aux)
        return len(todo)

    def messages(self, policy_version: int) -> dict[str, dict]:
        """worker -> what add_pairs takes: its sequences' tokens and features, numpy arrays (bf16 as its bits)."""
        if self.missing:
            raise RuntimeError(f"{len(self.missing)} sequences' features were never recorded")
        out: dict[str, dict] = {}
        for wid, feats in self.features.items():
            seqs = [b for b, (w, _) in self.slots.items() if w == wid]  # in row order
            tokens = np.fromiter((t for b in seqs for t in self.sequences[b]), dtype=np.int32)
            out[wid] = {"policy_version": int(policy_version), "lengths": [len(self.sequences[b]) for b in seqs],
                        "num_prompt": [int(self.prompt_lens[b]) for b in seqs], "tokens": tokens,
                        "hidden": as_numpy(feats), "hidden_dtype": DTYPE_NAMES[feats.dtype]}
        return out


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Without a copy; numpy has no bfloat16, so bf16 travels as its 16-bit patterns."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def from_numpy(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """as_numpy's inverse, without a copy (a read-only array mapped from Ray's object store is only read)."""
    dtype = {name: d for d, name in DTYPE_NAMES.items()}.get(dtype_name)
    if dtype is None:
        raise ValueError(f"hidden_dtype must be one of {tuple(DTYPE_NAMES.values())}, got {dtype_name!r}")
    with warnings.catch_warnings():  # from_numpy on a read-only array
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.asarray(a))
    expected = torch.int16 if dtype == torch.bfloat16 else dtype
    if t.dtype != expected:
        raise ValueError(f"hidden is {t.dtype}, expected {expected} for hidden_dtype {dtype_name!r}")
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def add_pairs(buffer: RolloutBuffer, message: dict, feature_size: int) -> int:
    """Add one LearnerPairs message to `buffer` as the engine's harvest would have (RolloutBuffer.add_outputs:
    tokens = prompt + response, num_prompt = the prompt's length); returns the pairs added. A malformed message
    raises ValueError naming the field before anything is added (the buffer checks each rollout's ids, version
    and prompt length as it adds it)."""
    try:
        version, lengths, num_prompt = message["policy_version"], list(message["lengths"]), list(message["num_prompt"])
        tokens = torch.from_numpy(np.asarray(message["tokens"], dtype=np.int32))
        hidden = from_numpy(message["hidden"], message["hidden_dtype"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"learner pairs: a message needs policy_version, lengths, num_prompt, tokens, hidden and "
                         f"hidden_dtype ({one_line(e)})") from None
    if len(num_prompt) != len(lengths) or any(not isinstance(n, int) or n < 2 for n in lengths):
        raise ValueError("learner pairs: lengths must be ints >= 2, one per num_prompt")
    num_pairs = sum(lengths) - len(lengths)
    if tuple(tokens.shape) != (sum(lengths),):
        raise ValueError(f"learner pairs: tokens has shape {tuple(tokens.shape)}, lengths sum to {sum(lengths)}")
    if hidden.dim() != 2 or tuple(hidden.shape) != (num_pairs, feature_size):
        raise ValueError(f"learner pairs: hidden has shape {tuple(hidden.shape)}, expected ({num_pairs}, "
                         f"{feature_size}) (a row per position but each sequence's last, the policy's feature width)")
    t = h = 0
    for n, p in zip(lengths, num_prompt):
        buffer.add(tokens[t : t + n], hidden[h : h + n - 1], version, p)
        t, h = t + n, h + n - 1
    return num_pairs


class PairShipments:
    """The driver's add_learner_pairs calls in flight (ref -> worker id). Not waited for when sent; `settle`
    (the next step, or the end of the run) logs the ones that failed: that worker trains on fewer pairs, and the
    job goes on."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.calls: dict = {}

    def send(self, workers: dict, messages: dict[str, dict]) -> None:
        for wid, message in messages.items():
            if wid in workers:  # a worker lost since the rollout gets nothing
                self.calls[workers[wid].add_learner_pairs.remote(message)] = wid

    def settle(self) -> int:
        """Wait for the calls in flight; returns the pairs they added."""
        import ray  # here: the learner's recording above runs where Ray is not installed (a bare GPU node)
        from ray.exceptions import RayError

        num_pairs = 0
        for ref, wid in self.calls.items():
            try:
                num_pairs += ray.get(ref)
            except RayError as exc:  # the worker raised (RayTaskError) or died (RayActorError)
                log.warning("job %s: worker %s did not take the learner's pairs: %s", self.job_id, wid, one_line(exc))
        self.calls.clear()
        return num_pairs
