"""Step profiles for the tests of the pure modules (`test_profile.py`, `test_simulate.py`, `test_search.py`): S1
(benchmarks/harness/scenarios.py) as measured on an H100, two layers in round numbers for examples computed by hand, and
an 8B shape at long context."""

from __future__ import annotations

import dataclasses

from hf_offload.memory_budget.profile import LayerProfile, StepProfile
from hf_offload.units import GIB, MIB


def s1_profile(layers: int = 16, **changes) -> StepProfile:
    """S1 (benchmarks/harness/scenarios.py), rebuilt from its measurements on an H100.

    Full checkpointing offloads 1.0 GiB of inputs (64 MiB per layer). No checkpointing peaks at the last layer's
    backward: static + 16 x saved + working = 38.88 GiB; full checkpointing at static + saved + working + one input
    = 12.35 GiB, so saved = (38.88 - 12.35 + input) / 15 = 1.773 GiB. Selective checkpointing everywhere peaks at
    24.88 GiB = static + 15 x selective + saved + working + input, so selective = 0.8355 GiB. A full checkpoint
    recomputes 5 ms, a selective one 2.3 ms; the step without checkpointing takes 307 ms.
    """
    layer = LayerProfile(
        saved_bytes=int(1.773 * GIB),
        selective_bytes=int(0.8355 * GIB),
        input_bytes=64 * MIB,
        forward_s=0.005,
        backward_s=0.010,
        selective_recompute_s=0.0023,
    )
    profile = StepProfile(
        layers=(layer,) * layers,
        static_bytes=int(8.512 * GIB),
        head_bytes=int(1.5 * GIB),
        backward_working_bytes=2 * GIB,
        head_s=0.040,
        other_s=0.027,
        d2h_bytes_per_s=55e9,
        h2d_bytes_per_s=55e9,
        host_cap_bytes=64 * GIB,
        tokens=16384,
    )
    return dataclasses.replace(profile, **changes)


def tiny_profile(**changes) -> StepProfile:
    """Two layers in round numbers (bytes, seconds), for examples computed by hand."""
    layer = LayerProfile(saved_bytes=100, selective_bytes=40, input_bytes=10, forward_s=1.0, backward_s=2.0,
                         selective_recompute_s=0.25)  # fmt: skip
    profile = StepProfile(layers=(layer, layer), static_bytes=1000, head_bytes=50, backward_working_bytes=30,
                          head_s=1.0, other_s=0.5, d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0,
                          host_cap_bytes=10**6, tokens=1)  # fmt: skip
    return dataclasses.replace(profile, **changes)


def long_profile(**changes) -> StepProfile:
    """An 8B-shape step at 256K tokens in round numbers: a layer's untiled activations (40 GiB, 20 GiB of gradient
    buffers) cannot fit next to 16 GiB of weights on an 80 GiB device; tiled, its MLP's intermediates shrink to one
    chunk (1 GiB) and the layer's working set to 12 + 1 + 8 GiB. The host holds all 32 inputs (2 GiB each)."""
    layer = LayerProfile(
        saved_bytes=40 * GIB,
        selective_bytes=20 * GIB,
        input_bytes=2 * GIB,
        forward_s=2.0,
        backward_s=5.0,
        selective_recompute_s=0.5,
        tiled_saved_bytes=12 * GIB,
        tiled_extra_s=0.2,
    )
    profile = StepProfile(layers=(layer,) * 32, static_bytes=16 * GIB, head_bytes=3 * GIB,
                          backward_working_bytes=20 * GIB, head_s=1.0, other_s=0.5, d2h_bytes_per_s=55e9,
                          h2d_bytes_per_s=55e9, host_cap_bytes=64 * GIB, tokens=262144, tile_tokens=4096,
                          tiled_backward_working_bytes=8 * GIB, tile_chunk_bytes=GIB)  # fmt: skip
    return dataclasses.replace(profile, **changes)


def tiled_layer_profile(**changes) -> StepProfile:
    """`long_profile` with its layers also measured tiled whole (`L`, `l`), in round numbers near the 8B shape's at
    256K tokens (tiled_layer's counts: 16 KiB per token in the forward, 39.5 in the backward, of which 8 is the
    input): a tiled layer's forward holds 6 GiB (its input included), its backward 4 GiB more, one chunk 0.5 GiB;
    it costs 1 s more than a full checkpoint (one more attention forward). Every layer tiled whole peaks at
    16 + 6 + 0.5 + 4 + one 2 GiB reload = 28.5 GiB, with tiled MLPs at 39, fully checkpointed at 78."""
    layer = dataclasses.replace(long_profile().layers[0], layer_tiled_saved_bytes=6 * GIB, layer_tiled_extra_s=1.0)
    profile = long_profile(layers=(layer,) * 32, layer_tile_tokens=4096, layer_tiled_backward_working_bytes=4 * GIB,
                           layer_tile_chunk_bytes=GIB // 2)  # fmt: skip
    return dataclasses.replace(profile, **changes)
