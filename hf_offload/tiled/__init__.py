"""The sequence-tiled ops: a decoder layer's MLP, or the whole layer, run over chunks of tokens in forward and
backward, so that what a layer holds per token shrinks at long context. A feature of its own (`tile_mlp=True`,
`tile_layer=True`, `hf_offload.apply_tiled_mlp`) that the memory budget's plans also use (`T`/`t`, `L`/`l`).

As Liger-Kernel keeps its `ops/` apart from its `transformers/` patching, one module per part, imported one way:

- `chunks`: what the two ops share (the chunks' bounds, the autocast state their recompute replays, the dtypes whose
  gradients they sum in fp32).
- `mlp_op`: the tiled MLP, a `torch.autograd.Function` over any position-wise forward (`tiled_mlp`).
- `layer_op`: the tiled layer, a `torch.autograd.Function` over a layer call cut along the sequence, attention on the
  whole sequence by head groups; its bytes per token.
- `integration`: the ops in transformers' models: the decoder layers and their MLPs, the cut at the attention
  interface, the per-token arguments, the output recorders, the forwards installed.
- `apply`: the entry points, `apply_tiled_mlp` and `apply_tiled_layer`, and their handles (`ForwardsReplaced`).

A change to what runs over the chunks goes in an op module; a change to how a model's modules are found, cut, refused
or patched goes in `integration`. The ops import neither transformers nor `integration`. This package imports none of
its modules, so that the ops load without transformers.
"""

__all__: list[str] = []
