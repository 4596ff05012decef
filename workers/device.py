"""Where a job's tensors live: JobSpec.device resolved in the process that holds them.

Each process resolves the job's setting for itself, so one spec serves a mixed cluster:
    auto  CUDA where this process sees a CUDA device, else the CPU. A rollout worker sees the GPU Ray assigned
          it (`num_gpus` sets CUDA_VISIBLE_DEVICES: its GPU is cuda:0; on a CPU box with logical GPUs declared,
          torch sees none and it runs on the CPU). The driver asks Ray for no GPU and, on Ray >= 2.49, sees its
          node's GPUs: the learner runs on the first, beside the rollout workers whose phases it alternates
          with (docs/architecture.md, "The RL job on a GPU")
    cuda  CUDA, or a ValueError saying this process sees none (a job that asked for the GPU never runs on the CPU
          by mistake)
    cpu   the CPU, even where a GPU is visible
Torch-only, and torch only when called: workers.spec takes DEVICES from here without importing torch, and a bare
GPU node (the CUDA test set) runs it without pydantic.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cuda", "cpu")  # JobSpec.device's values
POLICY_DTYPES = ("auto", "float32", "bfloat16")  # JobSpec.policy_dtype's values


def job_device(setting: str) -> torch.device:
    """The device `setting` (JobSpec.device) means in this process. ValueError for "cuda" where no CUDA device
    is visible (naming what CUDA_VISIBLE_DEVICES holds), and for anything not in DEVICES."""
    if setting not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {setting!r}")
    import torch

    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError("device 'cuda': this process sees no CUDA device (torch "
                         f"{torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r}); a Ray worker sees the GPU Ray "
                         "assigned it, and a CPU build of torch sees none")
    return torch.device("cuda", torch.cuda.current_device())


def policy_dtype(setting: str, device: torch.device | str, coupled: bool = False) -> torch.dtype:
    """The precision `setting` (JobSpec.policy_dtype) means for a policy copy on `device`: auto is bfloat16 where
    the device runs bf16 matmuls natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX:
    drafter.model.linear.fast_bf16), float32 elsewhere (torch emulates bf16 there, slower than float32).
    coupled (JobSpec.coupled_sampling): auto is bfloat16 only on a CPU where a bf16 verify's logits are plain
    decoding's to the bit (bf16_rows_exact: the static path's GEMMs in row blocks, drafter.decode.projections), so
    coupled samples stay paired; float32 elsewhere and on GPUs, whose kernels are not probed (in bf16 coupled
    samples would part within tens of tokens).
    ValueError for anything not in POLICY_DTYPES."""
    if setting not in POLICY_DTYPES:
        raise ValueError(f"policy_dtype must be one of {', '.join(POLICY_DTYPES)}, got {setting!r}")
    import torch

    from drafter.model.linear import fast_bf16

    if setting == "auto" and coupled:
        return torch.bfloat16 if torch.device(device).type == "cpu" and bf16_rows_exact() else torch.float32
    if setting == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    return getattr(torch, setting)


def bf16_rows_exact() -> bool:
    """Whether this CPU has bf16 units and its static-path decode steps in bf16 give a verify's logits plain
    decoding's bits: a 2-layer random model of SmolLM2-135M's shapes verifies 17 rows x 4 tokens against the same
    tokens decoded one at a time over another slot bucket (drafter.decode.exactness.verify_is_plain; about 1 s,
    once per process)."""
    import torch

    from drafter.decode.exactness import verify_is_plain
    from drafter.model.linear import fast_bf16, onednn_serves

    return fast_bf16("cpu") and onednn_serves(torch.bfloat16) and verify_is_plain(torch.bfloat16)
