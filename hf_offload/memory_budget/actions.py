"""The per-layer actions a plan chooses among: one record each, which the step model, the search, the layers and the
controller all dispatch on.

A plan gives each decoder layer one `LayerAction`. Its letter is how plans are written in codes, tables and logs
("CCCCSSSSKKKK"); everything else reads the record's fields: its name (what `layer_actions` sets the layer to), whether
its input leaves the GPU, whether its other saved tensors do, and the tiling it uses (the tiled actions sum weight
gradients over chunks, so they are not bitwise exact and are chosen last). What each action costs in bytes and time
is the step model's (`simulate`'s docstring). A new action is a record here, its cost in `simulate.layer_options`,
and its layer function in `layer_actions`. Pure Python, like the rest of the planning.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "ACTIONS",
    "FULL",
    "FULL_TILED",
    "KEEP",
    "LayerAction",
    "NO_TILING",
    "OFFLOAD",
    "SELECTIVE",
    "SELECTIVE_LETTERS",
    "SAVED_OFFLOAD_LETTERS",
    "SELECTIVE_OFFLOAD",
    "TILED_LAYER",
    "TILED_LAYERS",
    "TILED_MLPS",
    "action_named",
]

# The actions' names, as `layer_actions` applies them and a plan's table prints them.
KEEP, OFFLOAD, SELECTIVE, SELECTIVE_OFFLOAD, FULL = "keep", "offload", "selective", "selective_offload", "full"
FULL_TILED = "full_tiled_mlp"
TILED_LAYER = "tiled_layer"
# The tilings, in the order the search falls back to them.
NO_TILING, TILED_MLPS, TILED_LAYERS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class LayerAction:
    """One per-layer action.

    Args:
        letter: its letter in plan codes (uppercase where the layer's input leaves the GPU, lowercase where a
            checkpoint keeps it).
        action: its name (`KEEP`, `OFFLOAD`, ...).
        offload_input: whether the layer's input leaves the GPU.
        offloads_saved: whether its saved tensors beyond the input leave the GPU too (offload, selective offload).
        tiling: `NO_TILING`, `TILED_MLPS` (its MLP over chunks) or `TILED_LAYERS` (the whole layer over chunks).
    """

    letter: str
    action: str
    offload_input: bool
    offloads_saved: bool = False
    tiling: int = NO_TILING

    @property
    def exact(self) -> bool:
        """Whether the layer computes exactly what it computes without a plan (only the tilings do not)."""
        return self.tiling == NO_TILING

    @property
    def moves(self) -> bool:
        """Whether any of the layer's tensors go to the host: a plan of actions that move nothing needs no engine."""
        return self.offload_input or self.offloads_saved


# Every action, by letter, in the order the plan tables explain them.
ACTIONS: dict[str, LayerAction] = {
    action.letter: action
    for action in (
        LayerAction("K", KEEP, offload_input=False),
        LayerAction("O", OFFLOAD, offload_input=True, offloads_saved=True),
        LayerAction("S", SELECTIVE, offload_input=True),
        LayerAction("s", SELECTIVE, offload_input=False),
        LayerAction("C", FULL, offload_input=True),
        LayerAction("c", FULL, offload_input=False),
        LayerAction("X", SELECTIVE_OFFLOAD, offload_input=True, offloads_saved=True),
        LayerAction("T", FULL_TILED, offload_input=True, tiling=TILED_MLPS),
        LayerAction("t", FULL_TILED, offload_input=False, tiling=TILED_MLPS),
        LayerAction("L", TILED_LAYER, offload_input=True, tiling=TILED_LAYERS),
        LayerAction("l", TILED_LAYER, offload_input=False, tiling=TILED_LAYERS),
    )
}
_BY_NAME = {(action.action, action.offload_input): action for action in ACTIONS.values()}
# The letters of the actions that checkpoint selectively: a model with in-place kernels rules them out
# (`StepProfile.selective_checkpoint`).
SELECTIVE_LETTERS = "".join(
    action.letter for action in ACTIONS.values() if action.action in (SELECTIVE, SELECTIVE_OFFLOAD)
)
# The letters of the actions that offload saved tensors beyond the input: a model whose layers save tensors the engine
# keeps in place rules them out (`StepProfile.offload_saved`).
SAVED_OFFLOAD_LETTERS = "".join(action.letter for action in ACTIONS.values() if action.offloads_saved)


def action_named(action: str, offload_input: bool) -> LayerAction:
    """The action called `action` with its input offloaded or kept.

    Raises:
        ValueError: no such action.
    """
    found = _BY_NAME.get((action, offload_input))
    if found is None:
        raise ValueError(f"no such layer action: {action!r} with offload_input={offload_input!r}; the actions are "
                         f"{sorted(_BY_NAME)}")  # fmt: skip
    return found
