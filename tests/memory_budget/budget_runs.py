"""Runs of the memory budget end to end in the CPU test mode, shared by the controller's tests and those of the
objects it owns (`test_controller.py`, `test_profiled_steps.py`, `test_plan_checks.py`, `test_planning.py`) and by
the ranks of `test_ranks.py` (`tests/ranks.py`): a tiny Llama and a few AdamW steps of it, with a context or
without; runs at 16 tokens a sequence under a budget (the smallest any plan fits, the profile a roomy one measures,
one that plain checkpointing with every input kept fits); runs of 128 tokens a step, whose MLPs and layers can be
tiled; micro-steps of gradient accumulation; and what the log says of profiled steps predicted over the budget."""

import logging
import re
from collections.abc import Callable

import pytest
import torch
import transformers

from hf_offload import InfeasibleBudgetError, get_act_offloading_ctx_manager
from hf_offload.memory_budget.simulate import simulate

LAYERS = 4
VOCAB = 128


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation="eager")  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def tiny_gemma3n() -> transformers.PreTrainedModel:
    """A tiny Gemma 3n text model (AltUp, Laurel, per-layer inputs, its last two layers sharing the others' keys and
    values), without the cache its forward would make."""
    torch.manual_seed(0)
    config = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_size_per_layer_input=16, laurel_rank=8, num_kv_shared_layers=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2), activation_sparsity_pattern=[0.0] * LAYERS,
        use_cache=False,
    )  # fmt: skip
    return transformers.Gemma3nForCausalLM(config).train()


def train(model, context, steps: int = 5, lengths: tuple[int, ...] = (16,),
          after_step: Callable[[], None] | None = None,
          shard: tuple[int, int] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Losses and, at the end, every gradient of a few AdamW steps (each step the next sequence length);
    `after_step` is called after each. With `shard` (index, count), the model sees that shard of each sequence,
    with its positions, as a rank does under context or sequence parallelism."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    results = []
    for step in range(steps):
        ids = torch.randint(VOCAB, (2, lengths[min(step, len(lengths) - 1)]))
        positions = None
        if shard is not None:
            index, count = shard
            width = ids.shape[1] // count
            ids = ids[:, index * width : (index + 1) * width]
            positions = torch.arange(index * width, (index + 1) * width).expand_as(ids)
        with context:
            loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
        results.append(loss.detach())
        if step == steps - 1:
            results += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
    return results


class Unchanged:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def assert_bitwise_equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def planned(budget) -> tuple[list[torch.Tensor], object]:
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    return train(model, context), context


def planned_minimum() -> int:
    """The smallest peak any plan reaches at 16 tokens, as the refusal of a budget of 1 byte names it."""
    with pytest.raises(InfeasibleBudgetError, match="budget") as error:
        planned(1)
    peak = error.value.lowest_plan.predicted.peak_bytes
    assert f"({peak} bytes" in str(error.value)
    return peak


def profiled_steps_over_the_budget(records: list[logging.LogRecord]) -> list[str]:
    """What the log says of profiled steps that run a plan predicted to peak over the budget."""
    said = [record.getMessage() for record in records]
    return [message for message in said if re.search("the profiled steps run plan .*over (it|the budget)", message)]


def tiled_forwards(model) -> list[bool]:
    return [type(layer.mlp.__dict__.get("forward")).__name__ == "_TiledForward" for layer in model.model.layers]


def tiled_whole(model) -> list[bool]:
    return [type(layer.__dict__.get("forward")).__name__ == "_TiledLayerForward" for layer in model.model.layers]


def long_run(budget, tile_mlp="auto", steps: int = 4, tile_layer="auto", record=tiled_forwards):
    """128 tokens per step, twice the hidden size (64): the MLPs and the layers can run in two chunks. Which layers
    were tiled (`record`: their MLPs, or whole) is recorded during each step's forward."""
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget, tile_mlp=tile_mlp,
                                             tile_layer=tile_layer)  # fmt: skip
    seen = []
    model.model.norm.register_forward_pre_hook(lambda *_: seen.append(record(model)))
    return train(model, context, steps=steps, lengths=(64,)), context, seen, model


def accumulate(model, context, micro_steps: int, accumulation: int, optimizer: bool = True,
               after_micro_step: Callable[[], None] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Losses of `micro_steps` forwards and backwards of 16 tokens, AdamW stepping after every `accumulation` of them
    (with `optimizer`; else the gradients only accumulate); then every gradient."""
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    torch.manual_seed(1)
    results = []
    for step in range(micro_steps):
        ids = torch.randint(VOCAB, (2, 16))
        with context:
            loss = model(input_ids=ids, labels=ids).loss
        (loss / accumulation).backward()
        results.append(loss.detach())
        if adamw is not None and (step + 1) % accumulation == 0:
            adamw.step()
            adamw.zero_grad(set_to_none=True)
        if after_micro_step is not None:
            after_micro_step()
    return results + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def roomy_profile():
    """The profile a roomy budget's run measured (the CPU test mode's are the same from run to run)."""
    return planned(10 * 2**30)[1].budget_controller.profile


def budget_for_the_trial() -> int:
    """A budget that plain checkpointing (inputs kept) fits with the plans' margin and keeping everything does not."""

    profile = roomy_profile()
    kept_inputs, keep_all = (simulate(profile, letter * LAYERS).peak_bytes for letter in "cK")
    budget = (kept_inputs + keep_all) // 2
    margin = budget // 200
    assert kept_inputs <= budget - margin < keep_all
    return budget
