"""A stand-in for Liger's rotary embedding on CPU: it writes the rotated queries and keys into the projections'
outputs in place, unseen by autograd and by dispatch modes (as Liger's Triton kernel does), and is patched into
transformers' Llama code as `apply_liger_kernel_to_llama` patches Liger's (`modeling_llama.apply_rotary_pos_emb`),
named as a function of `liger_kernel`."""

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes
from transformers.models.llama import modeling_llama

_ROTATE = modeling_llama.apply_rotary_pos_emb


class _InPlaceRotation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        with torch.no_grad(), _disable_current_modes():
            rotated_q, rotated_k = _ROTATE(q, k, cos, sin)
            q.copy_(rotated_q)
            k.copy_(rotated_k)
        ctx.save_for_backward(cos, sin)
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        # The rotation's transpose: x * cos + rotate_half(x) * sin, with rotate_half's transpose -rotate_half.
        cos, sin = (table.unsqueeze(1) for table in ctx.saved_tensors)
        return *(grad * cos - modeling_llama.rotate_half(grad * sin) for grad in (grad_q, grad_k)), None, None


def in_place_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return _InPlaceRotation.apply(q, k, cos, sin)


in_place_rotary_pos_emb.__module__ = "liger_kernel.transformers.rope"


def patch_in_place_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch the stand-in into transformers' Llama code for the test (`monkeypatch` undoes it)."""
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", in_place_rotary_pos_emb)
