"""CPU int8 linear products: torch's dynamic int8 kernels (fbgemm/x86) on weights quantized per output channel,
activations quantized per call. `Int8Linear` and `quantize_int8` serve an int8 draft head; `int8_prepack` and
`int8_product` serve a float head's products on int8 copies of its weights (drafter.model.linear.PackedWeight.int8,
draft_int8_pays)."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn


@functools.cache
def int8_linear_available() -> bool:
    """Whether this torch runs dynamic int8 linear layers on the CPU (fbgemm or x86 quantized engine):
    int8 weights per output channel, activations quantized per call."""
    ops = torch.ops.quantized
    return (torch.backends.quantized.engine in ("x86", "fbgemm") and hasattr(ops, "linear_dynamic")
            and hasattr(ops, "linear_prepack"))


def int8_prepack(weight: torch.Tensor, bias: torch.Tensor | None):
    """A float weight (out, in) as torch's dynamic int8 kernels take it: symmetric, one scale per output channel,
    packed with the bias (float32)."""
    if not int8_linear_available():
        raise ValueError("int8 linear layers need torch's fbgemm/x86 quantized engine (an x86 CPU build)")
    w = weight.detach().float().cpu()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; the kernels are not
        warnings.simplefilter("ignore", UserWarning)
        qw = torch.quantize_per_channel(w, scale, torch.zeros(len(scale), dtype=torch.long, device="cpu"), 0,
                                         torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float().cpu())


def int8_product(x: torch.Tensor, packed, out_features: int) -> torch.Tensor:
    """x (..., in) @ W.T + b on int8_prepack's `packed` W and b, in x's dtype: x quantized per call (7-bit, so
    AVX2 kernels without VNNI cannot saturate their int16 sums), the product in float32."""
    shape = x.shape
    out = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float(), packed, True)
    return out.view(*shape[:-1], out_features).to(x.dtype)


class Int8Linear(nn.Module):
    """Inference-only linear layer with int8 weights (symmetric, one scale per output channel) and
    float32 activations quantized per call (torch's dynamic quantization kernels, fbgemm/x86). A
    quarter of float32's bytes per call: for a draft head at batch 1, which is bound by reading its
    weights, that is what a draft step costs on a CPU without bf16 units. Built from a float weight,
    which it does not keep."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self._packed = int8_prepack(weight, bias)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x.float(), self._packed, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(module: nn.Module) -> nn.Module:
    """Replace every Linear in `module` by an Int8Linear, in place; returns the module."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child.weight, child.bias))
        else:
            quantize_int8(child)
    return module
