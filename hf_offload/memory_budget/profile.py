"""What a training step costs, as the controller measures it in the first steps: per decoder layer (`LayerProfile`)
and for the whole step (`StepProfile`), at one number of tokens, and how both scale to another number of tokens
(memory in proportion to the tokens, attention's time with their square). Pure Python: the input of the step model
(`simulate`) and of the search for a plan (`search`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .checks import check_bytes, check_seconds, is_int

__all__ = ["LayerProfile", "StepProfile", "in_proportion", "tiling_available", "layer_tiling_available"]


def in_proportion(amount: int, measured_tokens: int, tokens: int) -> int:
    """An amount (bytes, tokens) measured at `measured_tokens`, in proportion at `tokens`, rounded up (exact integer
    arithmetic)."""
    return -(-amount * tokens // measured_tokens)


def in_square(amount: int, measured_tokens: int, tokens: int) -> int:
    """An amount measured at `measured_tokens` that grows with the square of the tokens, at `tokens`, rounded up."""
    return -(-amount * tokens**2 // measured_tokens**2)


def with_square(amount: int, quadratic: int, measured_tokens: int, tokens: int) -> int:
    """Bytes measured at `measured_tokens`, of which `quadratic` grow with the square of the tokens (eager attention's
    weights, tokens x tokens a head) and the rest in proportion, at `tokens`; rounded up."""
    return in_proportion(amount - quadratic, measured_tokens, tokens) + in_square(quadratic, measured_tokens, tokens)


@dataclass(frozen=True)
class LayerProfile:
    """What one decoder layer costs, as measured at `StepProfile.tokens` tokens.

    Args:
        saved_bytes: bytes its saved tensors occupy between its forward and its backward when it keeps them,
            its input included.
        selective_bytes: bytes a selective checkpoint keeps (matmul and attention outputs), its input excluded.
        input_bytes: its input, all that a full checkpoint saves.
        forward_s: its forward; also what a full checkpoint recomputes.
        backward_s: its backward, without any recomputation.
        selective_recompute_s: what a selective checkpoint recomputes in backward.
        attention_forward_s: the part of `forward_s` that grows with the square of the tokens.
        attention_backward_s: the part of `backward_s` that grows with the square of the tokens.
        parameter_gradient_bytes: the gradients of its trainable parameters, which its backward creates.
        tiled_saved_bytes: what `saved_bytes` becomes with its MLP tiled: the MLP's intermediates are gone, its
            input stays (a chunk's intermediates are the step's `tile_chunk_bytes`). Used only when the step's
            `tile_tokens` is set.
        tiled_extra_s: what tiling its MLP adds to a full checkpoint's backward: one more forward of the MLP (the
            recompute runs the tiled forward just to save its input, the backward recomputes each chunk again) and
            the chunks' smaller matrix products.
        layer_tiled_saved_bytes: what `saved_bytes` becomes with the whole layer tiled (`tiled.layer_op`): its input
            and the sequence-long tensors its forward holds at once (the output, attention's query, key, value and
            output), less one chunk's share (the step's `layer_tile_chunk_bytes`). Used only when the step's
            `layer_tile_tokens` is set.
        layer_tiled_extra_s: what tiling the whole layer adds to a full checkpoint's forward, recompute and backward:
            one more attention forward and (3 + G) forwards of the projections before attention (G head groups),
            and the chunks' smaller matrix products. Its attention part, at most `attention_forward_s`, grows with the
            square of the tokens.
        quadratic_saved_bytes: the part of `saved_bytes` that grows with the square of the tokens: eager attention's
            weights (a probe at two lengths separates it); 0 for fused attention, whose saved tensors are per token.
        quadratic_selective_bytes: the same part of `selective_bytes`.
        saved_tensors: how many distinct tensors (storages) the layer saves, what a whole-layer offload (`O`) sends
            through the engine's hooks one by one; 0 where not counted.
        gathered_parameter_bytes: its parameters' bytes while FSDP2 gathers them (0 unless the layer is sharded,
            `sharding`): held through its forward and its backward, and through the backward of the layer after it,
            which FSDP2 runs with this one gathered ahead. Under sharding `parameter_gradient_bytes` is the
            gradients' local shard, what lasts after the backward's reduce-scatter.
        forward_peak_bytes: the most its forward holds at once, its input included: its saved tensors so far and
            the temporaries among them (a LoRA adapter's cast input, an upcast norm's). A checkpoint's recomputation
            holds as much again inside its backward, while its output's gradient exists. 0 where not measured (no
            memory counter): then `saved_bytes` stands for it.
        quadratic_forward_peak_bytes: the part of `forward_peak_bytes` that grows with the square of the tokens.
    """

    saved_bytes: int
    selective_bytes: int
    input_bytes: int
    forward_s: float
    backward_s: float
    selective_recompute_s: float
    attention_forward_s: float = 0.0
    attention_backward_s: float = 0.0
    parameter_gradient_bytes: int = 0
    tiled_saved_bytes: int = 0
    tiled_extra_s: float = 0.0
    layer_tiled_saved_bytes: int = 0
    layer_tiled_extra_s: float = 0.0
    quadratic_saved_bytes: int = 0
    quadratic_selective_bytes: int = 0
    saved_tensors: int = 0
    gathered_parameter_bytes: int = 0
    forward_peak_bytes: int = 0
    quadratic_forward_peak_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("saved_bytes", "selective_bytes", "input_bytes", "parameter_gradient_bytes",
                     "tiled_saved_bytes", "layer_tiled_saved_bytes", "quadratic_saved_bytes",
                     "quadratic_selective_bytes", "saved_tensors", "gathered_parameter_bytes", "forward_peak_bytes",
                     "quadratic_forward_peak_bytes"):  # fmt: skip
            check_bytes("LayerProfile", name, getattr(self, name))
        for part, whole in (("quadratic_saved_bytes", "saved_bytes"), ("quadratic_selective_bytes", "selective_bytes"),
                            ("quadratic_forward_peak_bytes", "forward_peak_bytes")):  # fmt: skip
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(f"LayerProfile.{part} is part of {whole}, so it cannot exceed it: "
                                 f"{getattr(self, part)!r} > {getattr(self, whole)!r}")  # fmt: skip
        for name in ("forward_s", "backward_s", "selective_recompute_s", "attention_forward_s",
                     "attention_backward_s", "tiled_extra_s", "layer_tiled_extra_s"):  # fmt: skip
            check_seconds("LayerProfile", name, getattr(self, name))
        for part, whole in (("attention_forward_s", "forward_s"), ("attention_backward_s", "backward_s")):
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(f"LayerProfile.{part} is part of {whole}, so it cannot exceed it: "
                                 f"{getattr(self, part)!r} > {getattr(self, whole)!r}")  # fmt: skip

    def scaled(self, measured_tokens: int, tokens: int) -> LayerProfile:
        """The same layer measured at `measured_tokens`, predicted at `tokens` (see `StepProfile.scaled`)."""
        ratio = tokens / measured_tokens

        def grow_time(total: float, attention: float) -> float:
            return (total - attention) * ratio + attention * ratio * ratio

        return dataclasses.replace(  # parameter gradients do not grow with the tokens
            self,
            saved_bytes=with_square(self.saved_bytes, self.quadratic_saved_bytes, measured_tokens, tokens),
            selective_bytes=with_square(self.selective_bytes, self.quadratic_selective_bytes, measured_tokens, tokens),
            quadratic_saved_bytes=in_square(self.quadratic_saved_bytes, measured_tokens, tokens),
            quadratic_selective_bytes=in_square(self.quadratic_selective_bytes, measured_tokens, tokens),
            forward_peak_bytes=with_square(
                self.forward_peak_bytes, self.quadratic_forward_peak_bytes, measured_tokens, tokens
            ),
            quadratic_forward_peak_bytes=in_square(self.quadratic_forward_peak_bytes, measured_tokens, tokens),
            input_bytes=in_proportion(self.input_bytes, measured_tokens, tokens),
            forward_s=grow_time(self.forward_s, self.attention_forward_s),
            backward_s=grow_time(self.backward_s, self.attention_backward_s),
            # What selective checkpointing drops is elementwise work, which grows with the tokens.
            selective_recompute_s=self.selective_recompute_s * ratio,
            attention_forward_s=self.attention_forward_s * ratio * ratio,
            attention_backward_s=self.attention_backward_s * ratio * ratio,
            tiled_saved_bytes=in_proportion(self.tiled_saved_bytes, measured_tokens, tokens),
            tiled_extra_s=self.tiled_extra_s * ratio,  # the MLP's work, per token
            layer_tiled_saved_bytes=in_proportion(self.layer_tiled_saved_bytes, measured_tokens, tokens),
            # One more attention forward, and per-token work.
            layer_tiled_extra_s=grow_time(
                self.layer_tiled_extra_s, min(self.layer_tiled_extra_s, self.attention_forward_s)
            ),  # fmt: skip
        )


@dataclass(frozen=True)
class StepProfile:
    """What one training step costs, as measured at `tokens` tokens: the planner's only input besides the budget.

    Args:
        layers: one `LayerProfile` per decoder layer, in forward order.
        static_bytes: memory held through the whole step: parameters, optimizer state (and gradients, when a
            gradient accumulation step starts with them).
        gradient_bytes: gradients that backward creates: absent in the forward and at the head's peak; at a layer's
            backward, all but those of the layers before it (`LayerProfile.parameter_gradient_bytes`).
        head_bytes: the head's and loss's peak on top of static memory and what the plan's layers hold (and the
            engine's tail): what the forward leaves besides (its last hidden states) is part of it.
        backward_working_bytes: transient gradient buffers of one layer's backward, on top of its activations.
        quadratic_backward_working_bytes: the part of `backward_working_bytes` that grows with the square of the
            tokens (the gradient of eager attention's weights).
        head_s: the head and loss, forward and backward.
        other_s: the rest of the step: embedding, optimizer step, and so on.
        d2h_bytes_per_s: device-to-host bandwidth.
        h2d_bytes_per_s: host-to-device bandwidth.
        host_cap_bytes: pinned host bytes the pool may hold.
        disk_cap_bytes: what the disk tier (`disk_offload_dir`) may take of a step's offloaded bytes once the pinned
            pool is full: the disk's free space less its reserve; 0 without a tier. What a layer offloads that the pool
            has no room for goes there, in forward order, as the engine spills what the pool refuses
            (`simulate.offload_places`).
        disk_write_bytes_per_s, disk_read_bytes_per_s: the disk tier's measured bandwidths
            (`disk_tier.measure_disk_bandwidth`): a spilled copy goes out at the slower of the link and the disk's
            writes, and comes back at the slower of the link and its reads. 0 without a tier.
        tokens: tokens per step when this was measured.
        tile_tokens: tokens per chunk of a tiled MLP; 0 when tiling is not an option (not measured, switched off,
            or a layer has no MLP that can be tiled). Tiling is offered only for steps of more tokens than this.
        tiled_backward_working_bytes: `backward_working_bytes` of a layer whose MLP is tiled, less one chunk's share.
        tile_chunk_bytes: one chunk's MLP intermediates and their gradients, at `tile_tokens` tokens: the part of
            a tiled layer's memory that does not grow with the step's tokens.
        layer_tile_tokens: tokens per chunk of a tiled layer (`tiled.layer_op`); 0 when tiling whole layers is not an
            option (not measured, switched off, or a layer cannot be tiled). Offered only for steps of more tokens.
        layer_tiled_backward_working_bytes: what a tiled layer's backward needs on top of its
            `LayerProfile.layer_tiled_saved_bytes`, less one chunk's share: the output's and the input's gradients,
            attention's gradients, one head group's attention state, the weights' gradients.
        layer_tile_chunk_bytes: one chunk's working set in a tiled layer (the layer's activations and their
            gradients for `layer_tile_tokens` tokens): the part of its memory that does not grow with the step's tokens.
        tiled_backward_sequence_bytes, layer_tiled_backward_sequence_bytes: what a layer with its MLP tiled (a layer
            tiled whole) holds in all, its saved tensors included, in the phase of its backward over the whole
            sequence (attention's), where no chunk is alive: a floor under its bytes in backward, which at long
            context is above the chunk phase's (`probes.SEQUENCE_PHASE_CHUNKS`); 0 where not measured.
        late_gradient_bytes: the part of `gradient_bytes` that backward creates after every layer's backward (the
            input embeddings', unless tied to the head): absent at every layer's backward.
        optimizer_bytes: what the step needs after backward on top of static memory and every gradient (the
            optimizer's temporaries), where measured.
        tail_bytes: the most that the engine's tail (the last offloaded tensors of the forward, kept on the GPU)
            holds through the head, on top of `head_bytes`.
        input_offload_s: host time each layer that sends its input to the host (`C`, `S`, `T`) adds to the step,
            beyond its copies: learned from measured steps (`calibrate`), as the model of the GPU's time has none.
        saved_offload_s: the same for each layer that sends its saved tensors to the host (`O`, `X`).
        peak_correction_bytes: what every point of the step's memory is raised by: the most that a plan that ran
            peaked above the model's prediction of it (learned by the controller from the peaks it measured
            exactly), so that the plans that did not run are predicted no lower than the model has been wrong.
        call_argument_bytes: the tensors the model gives its layers besides their hidden states (attention masks,
            rotary tables, position ids), made each step before the layers and held until their backward: at every
            point of the step but the optimizer's (`probes.call_argument_storages`).
        quadratic_call_argument_bytes: the part of `call_argument_bytes` that grows with the square of the tokens
            (an eager attention mask).
        head_reload_hidden_bytes: how much of the reloads the head starts stays under the head's own peak: its
            prefetch point fires at the logits' gradient, when the loss's temporaries are gone, so the head's point
            of the model (which counts those reloads on top of `head_bytes`) is that much too high. Learned by the
            controller from the peaks it measured exactly (at least what a plan that ran peaked below that point).
        selective_checkpoint: whether a layer may be checkpointed selectively (`S`, `s`, `X`): not where the model
            runs kernels that write into a matrix product's output in place, unseen by autograd, which a selective
            checkpoint keeps for the recomputation (Liger's rotary embedding, `model.find_liger_functions`), nor where a
            layer's own code writes into one through an alias autograd does not track (`LayerProbe.selective_error`).
        offload_saved: whether a layer's saved tensors may be offloaded beyond its input (`O`, `X`): not where a layer
            saves tensors the engine keeps in place, tensor subclasses (`LayerProbe.offload_error`: torch's ring
            attention saves DTensors under context parallelism), which such a plan would count as moved.
        reloads_one_layer_ahead: whether the engine reloads one layer ahead in backward, whatever its prefetch window,
            under a plan whose layers send it their inputs alone (`OffloadActivations.reloads_one_block_ahead`: its
            prefetch points in the middle of each layer's backward); not where the model has no attention to place
            them at, where reloads go as far ahead as the window.
    """

    layers: tuple[LayerProfile, ...]
    static_bytes: int
    head_bytes: int
    backward_working_bytes: int
    head_s: float
    other_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_cap_bytes: int
    tokens: int
    gradient_bytes: int = 0
    tile_tokens: int = 0
    tiled_backward_working_bytes: int = 0
    tile_chunk_bytes: int = 0
    layer_tile_tokens: int = 0
    layer_tiled_backward_working_bytes: int = 0
    layer_tile_chunk_bytes: int = 0
    tiled_backward_sequence_bytes: int = 0
    layer_tiled_backward_sequence_bytes: int = 0
    late_gradient_bytes: int = 0
    optimizer_bytes: int = 0
    tail_bytes: int = 0
    input_offload_s: float = 0.0
    saved_offload_s: float = 0.0
    peak_correction_bytes: int = 0
    quadratic_backward_working_bytes: int = 0
    head_reload_hidden_bytes: int = 0
    call_argument_bytes: int = 0
    quadratic_call_argument_bytes: int = 0
    disk_cap_bytes: int = 0
    disk_write_bytes_per_s: float = 0.0
    disk_read_bytes_per_s: float = 0.0
    selective_checkpoint: bool = True
    offload_saved: bool = True
    reloads_one_layer_ahead: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or not all(isinstance(layer, LayerProfile) for layer in self.layers):
            raise ValueError(f"StepProfile.layers must be one or more LayerProfile, got {self.layers!r}")
        for name in ("static_bytes", "gradient_bytes", "head_bytes", "backward_working_bytes", "host_cap_bytes",
                     "tile_tokens", "tiled_backward_working_bytes", "tile_chunk_bytes", "layer_tile_tokens",
                     "layer_tiled_backward_working_bytes", "layer_tile_chunk_bytes", "tiled_backward_sequence_bytes",
                     "layer_tiled_backward_sequence_bytes", "late_gradient_bytes",
                     "optimizer_bytes", "tail_bytes", "peak_correction_bytes",
                     "quadratic_backward_working_bytes", "head_reload_hidden_bytes", "call_argument_bytes",
                     "quadratic_call_argument_bytes", "disk_cap_bytes"):  # fmt: skip
            check_bytes("StepProfile", name, getattr(self, name))
        for part, whole in (("quadratic_backward_working_bytes", "backward_working_bytes"),
                            ("quadratic_call_argument_bytes", "call_argument_bytes"),
                            ("late_gradient_bytes", "gradient_bytes")):  # fmt: skip
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(f"StepProfile.{part} is part of {whole}, so it cannot exceed it: "
                                 f"{getattr(self, part)!r} > {getattr(self, whole)!r}")  # fmt: skip
        for name in ("head_s", "other_s", "input_offload_s", "saved_offload_s"):
            check_seconds("StepProfile", name, getattr(self, name))
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            check_seconds("StepProfile", name, getattr(self, name), positive=True)
        for name in ("disk_write_bytes_per_s", "disk_read_bytes_per_s"):  # a disk tier needs both measured
            check_seconds("StepProfile", name, getattr(self, name), positive=bool(self.disk_cap_bytes))
        if not is_int(self.tokens) or self.tokens <= 0:
            raise ValueError(f"StepProfile.tokens must be an int > 0, got {self.tokens!r}")

    def scaled(self, tokens: int) -> StepProfile:
        """The same step at another number of tokens.

        Activation bytes grow in proportion to the tokens (rounded up), their quadratic parts (eager attention's
        weights) with the square, static, gradient and optimizer bytes do not,
        nor does a tiled MLP's or layer's chunk (`tile_tokens`, `tile_chunk_bytes`, `layer_tile_tokens`,
        `layer_tile_chunk_bytes`), the tail's bound, the peak's corrections or the host's and the disk's room; times
        grow in proportion too, except the attention parts, which grow with the square, and the host's time per
        offloading layer. The backward's working bytes grow whole, the layer's own parameter gradients in them
        included, which do not grow: a full fine-tune's longer steps are predicted high by them (docs/DESIGN.md).

        Args:
            tokens: the tokens per step to predict for.

        Returns:
            A new profile measured "as if" at `tokens`.

        Example:
            With `profile` as in `choose_plan`'s example:

            >>> profile.scaled(2 * profile.tokens).layers[0].saved_bytes == 2 * profile.layers[0].saved_bytes
            True
        """
        if not is_int(tokens) or tokens <= 0:
            raise ValueError(f"tokens must be an int > 0, got {tokens!r}")
        ratio = tokens / self.tokens

        def grow(nbytes: int) -> int:
            return in_proportion(nbytes, self.tokens, tokens)

        layers = tuple(layer.scaled(self.tokens, tokens) for layer in self.layers)
        return dataclasses.replace(
            self,
            layers=layers,
            head_bytes=grow(self.head_bytes),
            backward_working_bytes=with_square(
                self.backward_working_bytes, self.quadratic_backward_working_bytes, self.tokens, tokens
            ),
            quadratic_backward_working_bytes=in_square(self.quadratic_backward_working_bytes, self.tokens, tokens),
            call_argument_bytes=with_square(
                self.call_argument_bytes, self.quadratic_call_argument_bytes, self.tokens, tokens
            ),
            quadratic_call_argument_bytes=in_square(self.quadratic_call_argument_bytes, self.tokens, tokens),
            tiled_backward_working_bytes=grow(self.tiled_backward_working_bytes),
            layer_tiled_backward_working_bytes=grow(self.layer_tiled_backward_working_bytes),
            tiled_backward_sequence_bytes=grow(self.tiled_backward_sequence_bytes),
            layer_tiled_backward_sequence_bytes=grow(self.layer_tiled_backward_sequence_bytes),
            head_s=self.head_s * ratio,
            other_s=self.other_s * ratio,
            tokens=tokens,
        )


def tiling_available(profile: StepProfile) -> bool:
    """Whether the layers' MLPs can be tiled (`T`, `t`) in this step: tiling was measured, and the step has more
    tokens than one chunk (with fewer, a tiled MLP runs untiled)."""
    return 0 < profile.tile_tokens < profile.tokens


def layer_tiling_available(profile: StepProfile) -> bool:
    """Whether whole layers can be tiled (`L`, `l`) in this step: the tiled layer was measured, and the step has more
    tokens than one chunk (with fewer, a tiled layer runs untiled)."""
    return 0 < profile.layer_tile_tokens < profile.tokens
