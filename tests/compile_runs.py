"""What the torch.compile tests share, on the CPU (tests/test_compile.py) and on the GPU
(tests/gpu/test_gpu_compile.py): a small Llama trained for a few steps, compiled as a whole or layer by layer, with
offloading or without, and what a comparison needs (losses, weights, the graphs and graph breaks Dynamo made).
"""

from __future__ import annotations

import torch
import torch._dynamo
import transformers
from torch._dynamo.utils import counters

import hf_offload
from hf_offload.regional_compilation import checkpointed_side_effects_not_replayed

STEPS = 3


def build(checkpointing: bool, device: str, hidden: int = 64, layers: int = 2, vocab: int = 256) -> torch.nn.Module:
    """A random fp32 Llama on ``device`` (sdpa attention), checkpointed non-reentrantly or not, in training mode."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, use_cache=False,
                                      attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def train(compile_how: str, checkpointing: bool, offloading: bool, device: str = "cpu", context_first: bool = False,
          **model_shape: int) -> dict:  # fmt: skip
    """Trains ``STEPS`` SGD steps of `build(...)` compiled `compile_how` ("regional": each decoder layer, by
    `hf_offload.compile_decoder_layers`; "whole": `torch.compile(model)`), the offloading context built before or
    after compiling (``context_first``).

    Returns:
        The losses, the weights, the engine's statistics per step, and Dynamo's counts of graphs and graph breaks.
    """
    torch._dynamo.reset()
    counters.clear()
    model = build(checkpointing, device, **model_shape)
    # Offloading must move bytes here, on a step too short for it to lower the peak by the default share.
    options = {"device_type": "cpu", "min_offload_size": 0} if device == "cpu" else {"min_peak_reduction": None}
    context = None
    if offloading and context_first:
        context = hf_offload.get_act_offloading_ctx_manager(model, **options)
    if compile_how == "regional":
        hf_offload.compile_decoder_layers(model)
        runs = model
    else:
        # Compiled as one graph: transformers >= 5.25 checkpoints a layer whose attention sets a context variable,
        # which Dynamo traces inside a checkpoint only with this switch (see `hf_offload.regional_compilation`).
        runs = torch.compile(model)
    if offloading and not context_first:
        context = hf_offload.get_act_offloading_ctx_manager(runs, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(device)
    losses, stats = [], []
    for _ in range(STEPS):
        with context if context is not None else torch.enable_grad(), checkpointed_side_effects_not_replayed():
            loss = runs(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().cpu())
        stats.append(context.get_stats() if context is not None else None)
    return {
        "losses": losses,
        "weights": [p.detach().cpu().clone() for p in model.parameters()],
        "stats": stats,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }


def bitwise_equal(first: dict, second: dict) -> bool:
    """Whether two runs' losses and final weights are equal bit for bit."""
    return all(torch.equal(a, b) for a, b in zip(first["losses"], second["losses"])) and all(
        torch.equal(a, b) for a, b in zip(first["weights"], second["weights"])
    )
