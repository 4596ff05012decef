"""Batched generation with lossless speculative decoding; k=0 is plain decoding on the same path.

Per sequence the engine keeps `tokens` (prompt + generated) and the invariant
    cache.lens[b] == len(tokens[b]) - 1
i.e. every token but the last has its K/V in the cache. One step feeds [last, d_1..d_k] at
positions lens..lens+k, verifies the drafts, and appends n accepted drafts plus one token from
the policy (the correction or the bonus): n+1 new tokens for one policy forward.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from drafter.decode.coupled import Coupling
from drafter.decode.rows import Row, distinct_prompts, draw_uniforms
from drafter.decode.sampling import BatchSampling, SamplingParams, Verdict
from drafter.decode.static import ShapeCounts, StaticRunner, batch_bucket, slot_bucket, to_device
from drafter.decode.tree import Tree, compact_path, tree_attention, verify_tree
from drafter.decode.verify_graphs import VerifyGraphs
from drafter.draft.drafters import Drafter, widen
from drafter.draft.meter import DraftLengthChooser
from drafter.model.causal_lm import CausalLM, draft_features
from drafter.model.config import check_aux_layer_ids, default_aux_layer_ids


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    num_steps: int  # policy forwards this sequence took part in
    num_draft_tokens: int  # drafts proposed for it
    num_accepted: int  # drafts accepted
    text: str | None = None  # decoded, cut before a matched stop string
    # (N, F): the policy's features (drafter.model.causal_lm.draft_features: the aux layers' states, then the final
    # hidden state) at the position that produced token_ids[i]
    hidden_states: torch.Tensor | None = None
    prompt_hidden_states: torch.Tensor | None = None  # (P-1, F): features at prompt positions 0..P-2

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per policy forward (accepted drafts + the policy's own token)."""
        return len(self.token_ids) / max(self.num_steps, 1)


@dataclass
class EngineStats:
    """An engine's counters since it started (cumulative: callers take differences). The decode loop below fills
    the token counts; a rollout engine (workers.engine) adds its wall time and draft swaps."""

    num_forwards: int = 0  # batched policy forwards (prefill excluded)
    num_seq_steps: int = 0  # sum over forwards of the sequences in them
    num_generated: int = 0  # tokens generated
    num_draft_tokens: int = 0  # drafted tokens proposed
    num_accepted: int = 0  # drafted tokens accepted
    # sequence-steps that verified at least one drafted token: the swap guard's unit (workers.guard); an engine
    # that cannot count them leaves 0, and the guard then never judges its swaps
    num_verify_steps: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per sequence-step
    generate_seconds: float = 0.0  # wall time inside generate
    num_swaps: int = 0  # draft versions installed
    swap_seconds: float = 0.0  # time the decode loop spent switching drafts

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per sequence per policy forward; 1.0 before any forward (an empty count reads as plain decoding)."""
        return self.num_generated / self.num_seq_steps if self.num_seq_steps else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.generate_seconds if self.generate_seconds > 0 else 0.0


class Engine:
    def __init__(self, model: CausalLM, tokenizer=None, static: bool | None = None,
                 keep_buckets: bool | None = None) -> None:
        """static: run the policy on drafter.decode.static's path (static KV cache, bucketed batches, CUDA graphs on a
        GPU) instead of the eager one. None: the static path wherever it applies, which is every call on a GPU
        and, on a CPU, every call that drafts no tree: there its GEMMs on oneDNN's packed weights and its lean
        layer beat the eager path's ops (docs/benchmarks.md, "Engine"). The static path drafts chains only;
        draft trees run on the eager path. keep_buckets: see `keeps_bucket` (None: where graphs are captured)."""
        self.model, self.tokenizer, self.prefer_static, self.prefer_keep = model, tokenizer, static, keep_buckets
        self.static = True if static is None else bool(static)  # the path of the latest call
        self.runner: StaticRunner | None = None
        self.stats = EngineStats()
        self.shapes = ShapeCounts()  # captures and rebuilds of the static path, host reads (the bench's counters)
        # chains' verification: on CUDA one graph per shape (as StaticRunner's forwards), kept across runner rebuilds
        self.verifier = VerifyGraphs(model.cfg.vocab_size, model.device, model.device.type == "cuda", self.shapes)
        self._aranges: dict[int, torch.Tensor] = {}  # _steps
        # the latest step's next tokens (B, 1), and each live row's (drafts proposed, accepted) in it
        self._next_ids, self._row_accepts = None, []

    def static_runner(self, num_rows: int, max_len: int) -> StaticRunner:
        """The static path's runner, reused while its cache holds num_rows rows of max_len slots (its captured
        graphs with it), else built anew with room rounded up to a slot bucket."""
        runner = self.runner
        if runner is None or runner.cache.max_batch < num_rows or runner.cache.max_len < max_len \
                or runner.model is not self.model:
            self.runner = runner = None  # free the old cache first
            max_len = slot_bucket(max_len, self.model.cfg.max_position)
            runner = self.runner = StaticRunner(self.model, num_rows, max_len, shapes=self.shapes)
            self.shapes.num_rebuilds += 1
        runner.check_weights()
        runner.cache.num_used = 0
        return runner

    @property
    def keeps_bucket(self) -> bool:
        """Whether the latest call's batch keeps its bucket while rows finish (a finished row masked until the live
        rows fit a smaller one), as graphs captured per bucket need: keep_buckets, or where its forwards replay CUDA
        graphs. Uncaptured (a CPU) a masked row costs a live row's compute: each goes at once (docs/benchmarks.md,
        "Finished rows on a CPU")."""
        if self.static and self.prefer_keep is not None:
            return self.prefer_keep
        return self.static and self.runner is not None and self.runner.cuda_graphs

    def shapes_seen(self, drafter: Drafter | None) -> tuple[int, int]:
        """(captures, rebuilds) so far, the engine's and the drafter's: a step that changes them was not steady."""
        theirs = (drafter.shape_counts() if drafter is not None else None) or ShapeCounts()
        return self.shapes.num_captures + theirs.num_captures, self.shapes.num_rebuilds + theirs.num_rebuilds

    def validate(self, requests: list[Request], k: int, drafter: Drafter | None) -> None:
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"k (draft length) must be an int >= 0, got {k!r}")
        if k > 0 and drafter is None:
            raise ValueError("k > 0 needs a drafter")
        if not requests:
            raise ValueError("requests must not be empty")
        cfg = self.model.cfg
        for i, r in enumerate(requests):
            if len(r.prompt_ids) == 0:
                raise ValueError(f"prompt_ids of request {i} is empty")
            if len(r.prompt_ids) >= cfg.max_position:
                raise ValueError(f"prompt_ids of request {i} has {len(r.prompt_ids)} tokens; the context holds "
                                 f"{cfg.max_position} and at least one must be left to generate")
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= cfg.vocab_size:
                raise ValueError(f"prompt_ids of request {i} has token ids outside [0, {cfg.vocab_size})")
            if r.params.stop_strings and self.tokenizer is None:
                raise ValueError(f"stop_strings of request {i} need a tokenizer; this engine has none")

    @torch.inference_mode()
    def generate(self, requests: list[Request], k: int = 0, drafter: Drafter | None = None, record_hidden: bool = False,
                 on_step: Callable[[int, int], None] | None = None, tuner: DraftLengthChooser | None = None,
                 aux_layers: tuple[int, ...] | None = None) -> list[GenerationOutput]:
        """Generate for all requests as one batch. k: max draft tokens per step (0 = plain).
        record_hidden: return each position's policy features (drafter.model.causal_lm.draft_features) over
        `aux_layers` (None: the drafter's, else drafter.model.config.default_aux_layer_ids), the pairs a draft
        head trains on; a drafter that consumes features gets the same ones. Neither: no layer is kept.
        on_step(num_finished, num_generated) is called after every step (progress reporting).
        tuner: chooses each step's draft length in [0, k] from the live batch size, and is told the
        tokens each step emitted, its seconds (drafting + verifying) and whether it was steady (steps that
        captured or rebuilt anything or followed a change of k are not: they say nothing of the arm's cost);
        None: k every step. The choice depends only on past steps, so the outputs stay the policy's (greedy:
        identical to plain decoding).

        On the static path every step of a draft length has one shape: it drafts k and verifies k + 1 per row (a row
        near its cap drafts fewer, masked); a finished row stays, masked, until the live rows fit a smaller bucket."""
        self.validate(requests, k, drafter)
        model, device = self.model, self.model.device
        drafter = drafter if k > 0 else None
        limits = [min(len(r.prompt_ids) + r.params.max_new_tokens, model.cfg.max_position) for r in requests]
        rows = [Row(list(r.prompt_ids), r.params, model.cfg.eos_token_ids, lim, record_hidden, self.tokenizer)
                for r, lim in zip(requests, limits)]
        order = list(range(len(rows)))  # batch position -> index in `rows` (finished rows too, until compacted)
        sampling = BatchSampling.from_params([r.params for r in requests], device)
        # coupled rows (drafter.decode.coupled): greedy chains over perturbed logits (sampling.coupling)
        coupling = Coupling.of([r.params for r in requests], sampling, device)
        sampling = coupling.seen() if coupling is not None else sampling
        # the largest tree this call may draft, which only the eager path runs (it needs room for side slots)
        largest = drafter.tree_for(k) if drafter is not None and coupling is None else None
        self.static = self.prefer_static if self.prefer_static is not None else (
            device.type == "cuda" or largest is None)
        largest = None if self.static else largest
        if self.static:
            cache = self.static_runner(len(rows), max(limits)).cache
        else:
            cache = model.new_cache(len(rows), max(limits), extra=largest.num_nodes if largest is not None else 0)
        needs_hidden = drafter is not None and drafter.needs_hidden
        aux = self._aux_layers(drafter if needs_hidden else None, record_hidden, aux_layers)
        prefill_hidden = self._prefill(rows, cache, needs_hidden or record_hidden, aux)
        if record_hidden:
            width = (len(aux) + 1) * model.cfg.hidden_size
            for b, r in enumerate(rows):
                r.prompt_hidden = (prefill_hidden[b, : r.num_prompt - 1].clone() if prefill_hidden is not None
                                   else torch.zeros(0, width, dtype=model.dtype, device=device))
        if drafter is not None:
            drafter.begin([r.tokens for r in rows], prefill_hidden, max_len=cache.max_len)
        alive = torch.ones(len(rows), dtype=torch.long, device=device)  # (B,) 1 for a live row
        last_ids = None  # (B, 1) each row's last token, on the device: the previous step's next tokens
        last_k, num_finished = None, 0
        while order:
            batch = [rows[i] for i in order]
            num_live = len(batch) - sum(1 for r in batch if r.finish_reason)
            step_k = k if tuner is None or drafter is None else max(0, min(int(tuner.choose(num_live)), k))
            num_before = sum(len(r.tokens) for r in batch)
            marks = self.shapes_seen(drafter)
            start = time.perf_counter()
            tree = drafter.tree_for(step_k, len(batch)) if largest is not None else None  # the tail: a tree
            if tree is not None:
                n = tree.num_uniforms + tree.num_nodes
                uniforms = None if sampling.all_greedy else draw_uniforms(batch, n, device)
                self._tree_step(batch, cache, tree, drafter, sampling, uniforms, step_k, aux)
            else:
                uniforms = None if sampling.all_greedy else draw_uniforms(batch, 2 * step_k + 1, device)
                self._chain_step(batch, cache, drafter, sampling, uniforms, step_k, aux, alive, last_ids)
            last_ids = self._next_ids  # tree steps too: both end in _advance
            seconds = time.perf_counter() - start
            steady = step_k == last_k and marks == self.shapes_seen(drafter)
            if tuner is not None:
                tuner.record(num_live, step_k, sum(len(r.tokens) for r in batch) - num_before, seconds, steady)
                tuner.record_rows(num_live, step_k, [] if tree is not None else self._row_accepts)  # chains' only
                sources = drafter.step_sources() if step_k > 0 else None  # which source drafted: reported only
                if sources:
                    tuner.record_sources(num_live, sources)
            last_k = step_k
            finished = [j for j, r in enumerate(batch) if r.finish_reason]
            if on_step is not None:
                num_done = len(rows) - len(order) + len(finished)
                on_step(num_done, sum(len(r.tokens) - r.num_prompt for r in rows))
            if len(finished) > num_finished:
                num_finished = len(finished)
                keep = [j for j in range(len(batch)) if not batch[j].finish_reason]
                if not keep:
                    break
                if not self.keeps_bucket or batch_bucket(len(keep)) < batch_bucket(len(batch)):
                    order, alive, kept = self._compact(order, keep, cache, drafter)
                    sampling, last_ids = sampling.select(kept), last_ids.index_select(0, to_device(kept, device))
                    num_finished = 0
                else:
                    alive = to_device(torch.tensor([0 if r.finish_reason else 1 for r in batch], dtype=torch.long,
                                                   device="cpu"), device)
        return [self._output(r) for r in rows]

    def _compact(self, order: list[int], keep: list[int], cache, drafter) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Keep the batch positions `keep`, in order, as 0..len(keep)-1 (cache rows moved): the new order, the live
        mask (all live) and `keep` as a host tensor (sampling reads it back)."""
        rows = torch.tensor(keep, dtype=torch.long, device="cpu")  # the drafter reorders host-side rows by it
        cache.keep_rows(rows.to(self.model.device))
        if drafter is not None:
            drafter.keep_rows(rows)
        return [order[j] for j in keep], torch.ones(len(keep), dtype=torch.long, device=self.model.device), rows

    def _aux_layers(self, drafter: Drafter | None, record_hidden: bool,
                    aux_layers: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The policy layers whose states the forwards return (None: none is kept)."""
        num_layers = self.model.cfg.num_layers
        if drafter is not None:
            theirs = check_aux_layer_ids(drafter.aux_layers or default_aux_layer_ids(num_layers), num_layers)
            if aux_layers is not None and check_aux_layer_ids(aux_layers, num_layers) != theirs:
                raise ValueError(f"aux_layers {tuple(aux_layers)} differ from the drafter's {theirs}")
            return theirs
        if not record_hidden:
            return None
        return check_aux_layer_ids(aux_layers or default_aux_layer_ids(num_layers), num_layers)

    def _forward(self, aux: tuple[int, ...] | None, *args, num_slots: int, **kwargs
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The policy forward: (logits, hidden states), or with `aux` (logits, features). num_slots: one past the
        largest position fed, known on the host (the static path reads no position back)."""
        if self.static:
            input_ids, positions, _ = args
            return self.runner.forward(input_ids, positions, num_slots, aux, kwargs.get("logits_for", "all"))
        if aux is None:
            return self.model(*args, **kwargs)
        logits, hidden, states = self.model(*args, aux_layers=aux, **kwargs)
        return logits, draft_features(hidden, states)  # (B, T, 4D)

    def _chain_step(self, batch, cache, drafter, sampling, uniforms, k, aux=None, alive=None, last=None) -> None:
        """One verify forward of [last, d_1..d_k] per row (k = 0: plain decoding; a drafter still observes what
        the policy emitted, so it can draft again at a later step). Every row verifies k + 1 tokens whatever
        its draft length (a row near its cap, or finished, drafts fewer; its extra positions are masked)."""
        device = self.model.device
        if drafter is not None and k > 0:
            caps = [r.cap(k) for r in batch]
            prop = widen(drafter.propose([r.tokens for r in batch], caps, sampling,
                                         None if uniforms is None else uniforms[:, k + 1 :], width=k), k)
            K, draft_tokens, draft_lens = k, prop.tokens.to(device), prop.lens.to(device)
            draft_probs = prop.probs
        else:
            K, draft_tokens, draft_lens, draft_probs = 0, None, None, None
        if last is None:  # (B, 1): the prompts' last tokens; after a step, its next tokens, already on the device
            last = to_device(torch.tensor([[r.tokens[-1]] for r in batch], dtype=torch.long, device="cpu"), device)
        input_ids = last if K == 0 else torch.cat([last, draft_tokens], dim=1)  # (B, K+1)
        positions = cache.lens.unsqueeze(1) + self._steps(K + 1)  # (B, K+1)
        index = positions + 1  # the index in its row of the token each position samples (coupled rows' noise)
        # masked positions (past a row's draft, or a finished row's) lie past every real one, or at the last slot
        positions = positions.clamp_(max=cache.max_len - 1)
        num_slots = min(max(len(r.tokens) for r in batch) + K, cache.max_len)
        logits, hidden = self._forward(aux, input_ids, positions, cache, logits_for="all", num_slots=num_slots)
        if K == 0:
            draft_tokens = torch.zeros(len(batch), 0, dtype=torch.long, device=device)
            draft_lens = torch.zeros(len(batch), dtype=torch.long, device=device)
        if sampling.coupling is not None:  # coupled rows: greedy over logits / temperature + the row's Gumbel noise
            logits = sampling.coupling.perturb(logits, index)
        verify_u = None if uniforms is None else uniforms[:, : K + 1]  # K acceptance tests, then the final draw
        verdict = self.verifier.verify(logits, draft_tokens, draft_lens, draft_probs, sampling, verify_u)
        self._advance(batch, cache, verdict, draft_tokens, draft_lens, hidden, drafter, alive)

    def _steps(self, n: int) -> torch.Tensor:  # arange(n) on the device, made once per n
        if n not in self._aranges:
            self._aranges[n] = torch.arange(n, device=self.model.device)
        return self._aranges[n]

    def _tree_step(self, live, cache, tree: Tree, drafter, sampling, uniforms, k, aux=None) -> None:
        """One verify forward of [last, tree nodes] per row under the tree mask (drafter.decode.tree), then
        the accepted path's K/V moved to consecutive slots and its hidden states handed on in order."""
        model, device = self.model, self.model.device
        B, N = len(live), tree.num_nodes
        prop = drafter.propose_tree([r.tokens for r in live], [r.cap(k) for r in live], sampling,
                                    None if uniforms is None else uniforms[:, tree.num_uniforms :], tree)
        tokens, valid = prop.tokens.to(device), prop.valid.to(device)
        last = torch.tensor([[r.tokens[-1]] for r in live], dtype=torch.long, device=device)
        base = cache.lens
        # a node deeper than its row's cap is never accepted; its position only has to exist
        positions = (base.view(B, 1) + tree.depth.to(device).view(1, -1)).clamp_(max=model.cfg.max_position - 1)
        slots = base.view(B, 1) + torch.arange(N + 1, device=device).view(1, -1)
        mask = tree_attention(base, torch.arange(N + 1, device=device), tree, 0, int(base.max()) + N + 1)
        logits, hidden = self._forward(aux, torch.cat([last, tokens], dim=1), positions, cache, logits_for="all",
                                       tree=(slots, mask), num_slots=mask.shape[-1])
        verdict = verify_tree(logits, tree, tokens, valid, None if prop.probs is None else prop.probs.to(device),
                              sampling, None if uniforms is None else uniforms[:, : tree.num_uniforms])
        compact_path(cache, verdict.path, verdict.num_accepted)
        nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), verdict.path], dim=1)  # (B, D+1)
        path_hidden = hidden.gather(1, nodes.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        path_tokens = tokens.gather(1, (verdict.path - 1).clamp(min=0))
        self._advance(live, cache, Verdict(verdict.num_accepted, verdict.next_tokens), path_tokens,
                      valid.sum(1), path_hidden, drafter)

    def _prefill(self, rows: list[Row], cache, needs_hidden: bool, aux=None) -> torch.Tensor | None:
        """Run prompt[:-1] of every row through the policy (no logits needed). Rows with one prompt (a GRPO group)
        share a forward: each distinct prompt runs once as cache row u, then row b copies row source[b]."""
        device, (distinct, source) = self.model.device, distinct_prompts(rows)
        is_shared, P = len(distinct) < len(rows), max(len(p) for p in distinct)
        cache.lens = torch.tensor([len(p) for p in distinct], dtype=torch.long, device=device)
        if is_shared:  # rows 0..U-1 (an eager cache shrinks to U rows)
            cache.keep_rows(torch.arange(len(distinct), device=device))
        hidden = None  # (U, P, F) after the forward
        if P > 0:
            ids = torch.tensor([p + [0] * (P - len(p)) for p in distinct], dtype=torch.long, device=device)  # (U, P)
            positions = torch.arange(P, device=device).expand(len(distinct), P)  # right-padded: slots overwritten
            _, hidden = self._forward(aux, ids, positions, cache, logits_for="none", num_slots=P)
        if is_shared:
            index = torch.tensor(source, dtype=torch.long, device=device)
            cache.keep_rows(index)  # (U, ...) -> (B, ...)
            hidden = hidden.index_select(0, index) if hidden is not None and needs_hidden else None
        return hidden if needs_hidden else None

    def _advance(self, batch, cache, verdict, draft_tokens, draft_lens, hidden, drafter, alive=None) -> None:
        B, K = draft_tokens.shape
        # the step's one read-back: accepted counts, next tokens, drafts and draft lengths together
        packed = torch.cat([verdict.num_accepted.view(B, 1), verdict.next_tokens.view(B, 1),
                            draft_lens.view(B, 1), draft_tokens], dim=1).tolist()
        self.shapes.num_host_reads += 1
        new_tokens, self._row_accepts = [], []  # the live rows' (drafts proposed, accepted): the tuner's record_rows
        st = self.stats
        st.num_forwards += 1
        # recorded features: one copy of the step's (its buffers are overwritten next step), a view per row of it
        record = hidden is not None and batch and batch[0].hidden is not None
        kept = hidden[:, : max(p[0] for p in packed) + 1].clone() if record else None  # up to the most any row took
        for r, (n, nxt, num_drafted, *drafts) in zip(batch, packed):
            if r.finish_reason:  # finished before this step: masked, emits nothing
                new_tokens.append([])
                continue
            taken = r.append(drafts[:n] + [nxt])
            new_tokens.append(taken)
            r.steps += 1
            r.drafted += num_drafted
            r.accepted += n
            if kept is not None:
                r.hidden.append(kept[len(new_tokens) - 1, : len(taken)])
            st.num_seq_steps += 1
            st.num_generated += len(taken)
            st.num_draft_tokens += num_drafted
            st.num_accepted += n
            st.num_verify_steps += int(num_drafted > 0)
            st.accept_hist[n] += 1
            self._row_accepts.append((num_drafted, n))
        self._next_ids = verdict.next_tokens.view(B, 1)  # every live row's last token now (a finished row's: unused)
        grown = verdict.num_accepted + 1
        cache.lens = cache.lens + (grown if alive is None else grown * alive)  # a finished row's length stays
        if drafter is not None:
            drafter.observe(new_tokens, hidden)

    def _output(self, r: Row) -> GenerationOutput:
        gen = r.generated
        hidden = torch.cat(r.hidden)[: len(gen)] if r.hidden else None
        return GenerationOutput(list(r.prompt_ids), gen, r.finish_reason or "length", r.steps, r.drafted,
                                r.accepted, r.text(self.tokenizer), hidden, r.prompt_hidden)
