"""The static path's verification on CUDA: drafter.decode.sampling.verify captured in a CUDA graph per (batch
bucket, draft length, sampling mode) and replayed over static buffers.

On an H100 a speculative step of the static path is host-bound: the GPU was busy 2.1 ms of a 5.7 ms step at batch
4, k = 2 (docs/benchmarks.md, "The GPU run"), and verification at T=1 was half of the eager ops a step launched
outside the policy's and the draft's graphs (about 52 of 102: softmax, gathers, the rejection test, the residual,
inverse-CDF sampling). A replay launches them as one. The inputs are copied into buffers of the batch bucket's
rows (padded rows: nothing drafted, sampled at T=1, so they never change the batch's mode); the outputs are the
graph's own tensors, cloned.

Where no graph is kept (a CPU), and for rows that truncate (top-k/top-p read the device back), verify runs as it
is. `buffered` runs the buffered path uncaptured, so a CPU test checks its padding and copies.
"""

from __future__ import annotations

import logging

import torch

from drafter.decode.capture import capture
from drafter.decode.sampling import BatchSampling, Verdict, verify
from drafter.decode.static import ShapeCounts, batch_bucket

log = logging.getLogger(__name__)


class VerifyGraphs:
    """Verification for one Engine's chain steps (`vocab_size`: the policy's logits' width)."""

    def __init__(self, vocab_size: int, device: torch.device, cuda_graphs: bool,
                 shapes: ShapeCounts | None = None) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.cuda_graphs = cuda_graphs
        self.buffered = cuda_graphs  # a switch, so a CPU test runs the buffered path uncaptured
        self.shapes = shapes if shapes is not None else ShapeCounts()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Verdict]] = {}
        self.bufs: dict[tuple, dict[str, torch.Tensor]] = {}  # per (bucket, k, logits dtype, draft probs or not)
        self.pool = None

    def verify(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_lens: torch.Tensor,
               draft_probs: torch.Tensor | None, sampling: BatchSampling, uniforms: torch.Tensor | None) -> Verdict:
        """drafter.decode.sampling.verify's verdict, by a graph where one is kept (same arguments)."""
        if not self.buffered or sampling.truncates(self.vocab_size) or target_logits.shape[-1] != self.vocab_size:
            return verify(target_logits, draft_tokens, draft_lens, draft_probs, sampling, uniforms)
        if uniforms is None and not sampling.all_greedy:
            raise ValueError("uniforms are required when any row samples (temperature > 0)")
        B, K = draft_tokens.shape
        Bp = batch_bucket(B)
        greedy, has_probs = sampling.all_greedy, draft_probs is not None and not sampling.all_greedy
        b = self._buffers(Bp, K, target_logits.dtype, has_probs)
        b["logits"][:B].copy_(target_logits)
        b["tokens"][:B].copy_(draft_tokens)
        b["lens"][:B].copy_(draft_lens)
        if Bp > B:  # padded rows draft nothing and sample at T=1; their other inputs reach no result
            b["lens"][B:].zero_()
            if not greedy:
                b["temperature"][B:].fill_(1.0)
        if not greedy:
            b["temperature"][:B].copy_(sampling.temperature)
            b["uniforms"][:B].copy_(uniforms[:, : K + 1])
            if has_probs:
                b["probs"][:B].copy_(draft_probs)
        key = (Bp, K, target_logits.dtype, greedy, sampling.any_greedy, has_probs)
        if not self.cuda_graphs:
            verdict = self._verify(b, key)
        else:
            if key not in self.graphs:
                try:
                    self._capture(b, key)
                except RuntimeError:  # verify stays exact without the graph; the CUDA test set fails on this
                    log.exception("verify graph %s failed to capture: verifying eagerly from now on", key)
                    self.buffered = False
                    return verify(target_logits, draft_tokens, draft_lens, draft_probs, sampling, uniforms)
            graph, verdict = self.graphs[key]
            graph.replay()
        return Verdict(verdict.num_accepted[:B].clone(), verdict.next_tokens[:B].clone())

    def _buffers(self, Bp: int, K: int, dtype: torch.dtype, has_probs: bool) -> dict[str, torch.Tensor]:
        key = (Bp, K, dtype, has_probs)
        b = self.bufs.get(key)
        if b is None:
            dev, V = self.device, self.vocab_size
            b = self.bufs[key] = {
                "logits": torch.zeros(Bp, K + 1, V, dtype=dtype, device=dev),
                "tokens": torch.zeros(Bp, K, dtype=torch.long, device=dev),
                "lens": torch.zeros(Bp, dtype=torch.long, device=dev),
                "temperature": torch.ones(Bp, device=dev),  # padded rows sample at T=1: never one-hots
                "uniforms": torch.zeros(Bp, K + 1, device=dev),
                "probs": torch.zeros(Bp, K, V, device=dev) if has_probs else None,
            }
        return b

    @staticmethod
    def _verify(b: dict, key: tuple) -> Verdict:
        """verify over the buffers (capturable: no read-back). The host settings a graph is keyed by: whether
        every row is greedy and whether any is (greedy rows' one-hots)."""
        Bp, _, _, greedy, any_greedy, _ = key
        temperature = b["temperature"]
        host = ((0.0 if any_greedy else 1.0, 0, 1.0),) + ((1.0, 0, 1.0),) * (Bp - 1)
        sampling = BatchSampling(temperature, torch.zeros_like(b["lens"]), torch.ones_like(temperature),
                                 ((0.0, 0, 1.0),) * Bp if greedy else host)
        return verify(b["logits"], b["tokens"], b["lens"], b["probs"], sampling, None if greedy else b["uniforms"])

    def _capture(self, b: dict, key: tuple) -> None:
        """Capture one shape; its warm-up runs on the step's inputs (outputs the replay writes again)."""
        graph, verdict = capture(lambda: self._verify(b, key), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, verdict)
        self.shapes.num_captures += 1
