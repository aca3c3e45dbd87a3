"""The Trainer's `torch_compile=True` under activation offloading: the decoder layers compiled, not the whole model.

A model compiled as a whole hands every tensor its compiled forward saves for backward to the saved-tensor hooks at
once, after that forward's last kernel: the step's peak is behind it by then, so moving them cannot lower it, and
hf-offload stands aside (the engine's `_note_whole_model_compile`). Compiled layer by layer (regional compilation,
accelerate's `use_regional_compilation`, torchtitan's per-block compile), each layer's graph saves its tensors as
the layer ends, and hf-offload moves them while the next layers run, as it does without compilation. On the GPU it
was also the faster of the two with checkpointing (M36, 36 layers at 4,096 tokens: 0.230 s a step against 0.259 s
compiled whole on an H100, 0.225 s against 0.255 s on an H200). The loss is compiled as a region of its own
(`compile_loss`): eager, it holds the logits in float32 twice over, which a model compiled whole fuses away.

So a Trainer whose arguments ask for both `torch_compile` and activation offloading has accelerate compile nothing
(`claim_torch_compile`, as `Trainer.__init__` ends, before `prepare`), and its callback compiles each decoder layer
and the loss in place with the Trainer's own compile options as training begins (`compile_trainers_decoder_layers`):
the model trained then is the one whose layers are compiled, also when `model_init` builds a new one in `train()`.
One warning says so.
"""

import logging
from typing import Any

import transformers
from accelerate.utils import DynamoBackend, TorchDynamoPlugin
from torch import nn

from hf_offload.model import find_decoder_layers, unwrap_model
from hf_offload.regional_compilation import compile_decoder_layers, compile_loss

__all__ = ["claim_torch_compile", "compile_trainers_decoder_layers"]

logger = logging.getLogger(__name__)


def claim_torch_compile(trainer: transformers.Trainer) -> dict[str, Any] | None:
    """Keep accelerate from compiling the trainer's model as a whole; return the options its layers are compiled with.

    Called at the end of `Trainer.__init__`, before `train()` has accelerate prepare (and compile) the model. Leaves
    the trainer as it is when it compiles nothing, under FSDP or DeepSpeed (accelerate compiles those models its own
    way, around their sharding), and when the model has no decoder layers (`find_decoder_layers`): hf-offload then
    stands aside at the first step, with its own warning.

    Args:
        trainer: a trainer at the end of its `__init__`, whose arguments ask for activation offloading.

    Returns:
        The keyword arguments of `torch.compile` for `compile_decoder_layers`, or None when the trainer was left as
        it is.
    """
    if not trainer.args.torch_compile:
        return None
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return None
    if not find_decoder_layers(unwrap_model(trainer.model)):
        return None
    # The options the Trainer gives accelerate's plugin, read from the arguments: the plugin in accelerate's shared
    # state may be an earlier trainer's, already turned off below.
    compile_options = TorchDynamoPlugin(backend=trainer.args.torch_compile_backend or "inductor",
                                        mode=trainer.args.torch_compile_mode).to_kwargs()  # fmt: skip
    # accelerate's prepare compiles the model only while its plugin names a backend.
    plugin = getattr(trainer.accelerator.state, "dynamo_plugin", None)
    if plugin is not None:
        plugin.backend = DynamoBackend.NO
    return compile_options


def compile_trainers_decoder_layers(model: nn.Module, compile_options: dict[str, Any]) -> int:
    """Compile each decoder layer of the model about to be trained (`hf_offload.compile_decoder_layers`) and its loss
    (`hf_offload.compile_loss`), with one warning that says so.

    Args:
        model: the model about to be trained, bare or wrapped.
        compile_options: keyword arguments of `torch.compile` (`claim_torch_compile`'s).

    Returns:
        How many layers were compiled now.
    """
    layers = compile_decoder_layers(model, **compile_options)
    loss_compiled = compile_loss(model, **compile_options)
    if layers:
        logger.warning(
            "hf_offload: torch_compile=True with activation offloading compiles each of the model's %d decoder "
            "layers (%s)%s instead of the whole model: a model compiled as a whole hands its saved tensors over only "
            "after its forward, when moving them can no longer lower the step's peak.",
            len(layers),
            type(layers[0]).__name__,
            " and its loss" if loss_compiled else "",
        )
    return len(layers)
