"""Keeping hf-offload's Python out of what `torch.compile` traces.

When `torch.compile` traces a module, it inlines that module's forward hooks. hf-offload's hooks take locks, enter
saved-tensor hooks, read storage pointers and graph task ids: Dynamo cannot trace those, so each one would break the
compiled graph (measured on a 2-layer Llama: 1 graph without hf-offload, 7 graphs and 8 breaks with it), and a
graph cut into pieces computes in another order, so losses and weights stop being bitwise equal to the compiled run
without hf-offload. A hook wrapped by `eager_only` returns at once while Dynamo traces it: the test is constant
during tracing, so the compiled graph holds nothing of it, and the hook runs as usual wherever the module runs
eagerly (around regionally compiled decoder layers: the head, the loss, the model's own forward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["eager_only"]

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def eager_only(hook: _Hook) -> _Hook:
    """Wrap a module hook so that it does nothing inside code that `torch.compile` traces.

    Args:
        hook: a forward hook or forward pre-hook (a function or a method).

    Returns:
        The hook, returning None without running while Dynamo traces it.
    """

    @functools.wraps(hook)
    def hook_outside_compiled_code(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return hook(*args, **kwargs)

    return hook_outside_compiled_code  # type: ignore[return-value]
