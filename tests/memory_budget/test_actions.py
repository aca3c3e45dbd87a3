"""The per-layer actions' registry (`actions`): one record per letter, which every part of the budget reads."""

from __future__ import annotations

import pytest

from hf_offload.memory_budget.actions import (
    ACTIONS,
    NO_TILING,
    OFFLOAD,
    SELECTIVE_OFFLOAD,
    TILED_LAYERS,
    TILED_MLPS,
    action_named,
)


def test_each_letter_is_one_action_with_its_input_offloaded_or_kept():
    assert "".join(ACTIONS) == "KOSsCcXTtLl"
    for letter, action in ACTIONS.items():
        assert action.letter == letter
        assert action_named(action.action, action.offload_input) is action
        # Uppercase: the layer's input leaves the GPU; lowercase and `K`: a checkpoint keeps it.
        assert action.offload_input == (letter.isupper() and letter != "K")


def test_only_the_tilings_are_inexact_and_only_offloading_actions_move_tensors():
    assert [letter for letter, action in ACTIONS.items() if not action.exact] == list("TtLl")
    assert {ACTIONS[letter].tiling for letter in "Tt"} == {TILED_MLPS}
    assert {ACTIONS[letter].tiling for letter in "Ll"} == {TILED_LAYERS}
    assert {ACTIONS[letter].tiling for letter in "KOSsCcX"} == {NO_TILING}
    assert [letter for letter, action in ACTIONS.items() if action.offloads_saved] == ["O", "X"]
    assert {ACTIONS[letter].action for letter in "OX"} == {OFFLOAD, SELECTIVE_OFFLOAD}
    assert [letter for letter, action in ACTIONS.items() if not action.moves] == list("Ksctl")


def test_an_action_that_does_not_exist_is_named_in_the_error():
    with pytest.raises(ValueError, match="no such layer action: 'tile' with offload_input=True; the actions are"):
        action_named("tile", True)
    with pytest.raises(ValueError, match="no such layer action: 'keep' with offload_input=True"):
        action_named("keep", True)
