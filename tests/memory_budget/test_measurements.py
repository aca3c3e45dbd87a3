"""What the controller measures of the first steps (`hf_offload.memory_budget.measurements`): here the head's bytes
before the second step measures them, estimated from the model's configuration, and the logits of those that are
certain."""

import functools
import types

import torch
import transformers
from torch import nn

from hf_offload.memory_budget.measurements import first_steps_head_bytes, first_steps_logits_bytes


def tiny_llama(vocabulary: int = 256, hidden: int = 64) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=vocabulary, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_without_a_fused_loss_the_head_holds_the_logits_their_float32_copy_and_its_gradient():
    # 2 + 4 + 4 bytes per token and vocabulary entry: grows with the vocabulary, not the hidden size.
    assert first_steps_head_bytes(tiny_llama(), 1000) == 1000 * 256 * 10
    assert first_steps_head_bytes(tiny_llama(vocabulary=512, hidden=128), 1000) == 1000 * 512 * 10


def _lce_forward(self, *args, **kwargs):
    raise AssertionError("not called")


_lce_forward.__module__ = "liger_kernel.transformers.model.llama"


def _autocast_wrapped(model: nn.Module) -> None:
    """What accelerate's `prepare` does to the forward under mixed precision: the original kept, a wrapper set."""
    model._original_forward = model.forward

    @functools.wraps(model.forward.__func__)
    def forward(self, *args, **kwargs):
        return model._original_forward(*args, **kwargs)

    model.forward = types.MethodType(forward, model)


def test_with_ligers_fused_loss_the_head_holds_about_the_hidden_states_a_few_times_over():
    # A model whose forward is Liger's: no logits of the whole step, so the vocabulary does not count; the hidden size
    # does. Liger patches the class (`apply_liger_kernel_to_llama()`) or, given a model, the instance (what the
    # Trainer's `use_liger_kernel=True` does), which accelerate's mixed precision then wraps.
    by_class = tiny_llama(vocabulary=100_000)
    by_class.__class__ = type("LigerLlama", (transformers.LlamaForCausalLM,), {"forward": _lce_forward})
    by_instance = tiny_llama(vocabulary=100_000)
    by_instance.forward = types.MethodType(_lce_forward, by_instance)
    wrapped = tiny_llama(vocabulary=100_000)
    wrapped.forward = types.MethodType(_lce_forward, wrapped)
    _autocast_wrapped(wrapped)
    for model in (by_class, by_instance, wrapped):
        assert first_steps_head_bytes(model, 1000) == 1000 * 64 * 12
        assert first_steps_logits_bytes(model, 1000) == 0  # it never makes them whole


def test_the_logits_of_transformers_own_forward_are_certain_in_the_heads_dtype():
    model = tiny_llama(vocabulary=1000)
    assert first_steps_logits_bytes(model, 100) == 100 * 1000 * 4
    assert first_steps_logits_bytes(model.to(torch.bfloat16), 100) == 100 * 1000 * 2
    _autocast_wrapped(model)
    assert first_steps_logits_bytes(model, 100) == 100 * 1000 * 2


def test_a_model_whose_configuration_names_no_sizes_counts_no_head():
    assert first_steps_head_bytes(nn.Linear(4, 4), 1000) == 0
    assert first_steps_logits_bytes(nn.Linear(4, 4), 1000) == 0
