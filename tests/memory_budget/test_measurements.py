"""What the controller measures of the first steps (`hf_offload.memory_budget.measurements`): here the head's bytes
before the second step measures them, estimated from the model's configuration."""

import transformers
from torch import nn

from hf_offload.memory_budget.measurements import first_steps_head_bytes


def tiny_llama(vocabulary: int = 256, hidden: int = 64) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=vocabulary, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_without_a_fused_loss_the_head_holds_the_logits_their_float32_copy_and_its_gradient():
    # 2 + 4 + 4 bytes per token and vocabulary entry: grows with the vocabulary, not the hidden size.
    assert first_steps_head_bytes(tiny_llama(), 1000) == 1000 * 256 * 10
    assert first_steps_head_bytes(tiny_llama(vocabulary=512, hidden=128), 1000) == 1000 * 512 * 10


def test_with_ligers_fused_loss_the_head_holds_about_the_hidden_states_a_few_times_over():
    # A model whose forward is Liger's (as `apply_liger_kernel_to_llama` patches the class's forward): no logits of the
    # whole step, so the vocabulary does not count; the hidden size does.
    model = tiny_llama(vocabulary=100_000)

    def lce_forward(self, *args, **kwargs):
        raise AssertionError("not called")

    lce_forward.__module__ = "liger_kernel.transformers.model.llama"
    patched = type("LigerLlama", (transformers.LlamaForCausalLM,), {"forward": lce_forward})
    model.__class__ = patched
    assert first_steps_head_bytes(model, 1000) == 1000 * 64 * 12


def test_a_model_whose_configuration_names_no_sizes_counts_no_head():
    assert first_steps_head_bytes(nn.Linear(4, 4), 1000) == 0
