"""oneDNN-prepacked fp32 linears for CPU inference (opt-in).

Why: on CPUs without bf16 matmul units, fp32 ``F.linear`` repacks its weight on every call and has a slow
small-M path, so verifying k tokens costs much more than it should (measured on the project's 2-core AVX2 box:
verify(8)/verify(1) 1.64 plain vs 1.47 prepacked, and plain decoding 14 -> 20 tok/s). Packing each weight once
removes that. Results differ from ``F.linear`` in the last bits (~1e-4 on logits), so compare a packed model's
speculative output with the *same packed model's* plain output.

Inference only: with gradients enabled, or off CPU, or in another dtype, the module falls back to ``F.linear``
on the original weight, which it keeps (tied embeddings keep working).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class PrepackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, so tied weights and state_dict stay as they were
        self.bias = linear.bias
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked=oneDNN"


def prepacking_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def prepack_linears(model: nn.Module) -> nn.Module:
    """Replace every fp32 CPU ``nn.Linear`` in ``model`` (in place) by a :class:`PrepackedLinear`."""
    if not prepacking_available():
        logger.warning("oneDNN prepacking is not available in this torch build; model left unchanged")
        return model
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(parent, name, PrepackedLinear(child))
                replaced += 1
    logger.info("Prepacked %d linear layers for oneDNN", replaced)
    return model
