#!/usr/bin/env python3
"""Trains every causal-LM family the installed transformers provides with hf-offload, as a new user would, and says
which families break the library: run it after each new transformers release.

The families are transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, each built as `AutoModelForCausalLM.from_config`
builds it from its `CONFIG_MAPPING` config. Per family, in a worker process of its own (forked from this one, killed
after --timeout: a crash or a hang stops that family only):

a. A tiny config, random weights, no download: the tests' own tiny config where `tests/gpu/_gpu_models.py` has one,
   else the family's default config shrunk field by field (`tiny_config`: widths, layers, heads, experts, ranks,
   windows, state sizes; per-layer lists such as `layer_types` cut to the fewest layers that hold every kind), with
   what a few families need besides in `OVERRIDES`. Every dropout probability is 0 (tiling draws dropout masks chunk
   by chunk, so only a dropout-free model compares), and the MoE routers' logits are on (the auxiliary loss).
b. The baseline: 6 AdamW steps without hf-offload, twice (a comparison means something only where it repeats), then
   with transformers' non-reentrant activation checkpointing. Offloading (the CPU test mode, `device_type="cpu"`) with
   checkpointing must give losses and gradients bitwise equal (`torch.equal`) to checkpointing alone (offloading alone
   against the baseline where the family cannot checkpoint), and must move bytes: one that moves nothing is equal
   trivially, and saves nothing. Where transformers computes otherwise with its cache on
   in training, which checkpointing turns off, every run is compared with `use_cache=False`.
c. Under a memory budget in the CPU test mode, with the default options (tiling where no plan fits without it): a
   roomy budget (10 GiB); a budget of 1 byte, whose refusal (`InfeasibleBudgetError`) names the smallest budget that
   works, which then runs ("minimum"); one halfway between that and the roomy plan's predicted peak; and a cold long
   first step: every step 4x as long, the probes cut to 40 of its 384 tokens (`PROBE_MAX_TOKENS`: 32K on a GPU), at
   the smallest budget its own refusal names. Each must train without an exception. Each step is compared with a
   reference run without hf-offload at the same weights (so a difference is that step's own, not the optimizer's
   amplification of an earlier one): a step whose plans tiled no layer must be bitwise equal, a tiled one within
   `TILED_TOLERANCE` of each gradient's scale; the table reports the largest difference. What the library refuses
   by design and says so up front (`REFUSALS`: a budget for a model without decoder layers) is reported, not failed.
   The plans follow the step times the library measures, so they can differ from run to run: an action that breaks a
   family where the planner chooses it (a selective checkpoint, say) shows only in the runs that choose it.
d. A family whose tiny config or model does not build (`no-config`), or that does not train without hf-offload
   (`transformers-fails`), is reported as such, not as a failure of the library; so is a baseline that does not
   repeat (no bitwise comparison then) or checkpointing that is not exact without hf-offload (then the budget's steps
   are not held bitwise).

Output: a markdown table on stdout (one row per family: status, built, bitwise, each budget case with its plan, the
largest gradient difference, seconds), then a summary with each failure; progress on stderr; with --out, a JSON file
of everything, tracebacks included. The exit status is 1 when any family fails on hf-offload's account (`FAIL`: an
exception, a difference, a timeout or a crash in a check of the library), else 0.

    python scripts/families_sweep.py --out /tmp/families.json             # every family: ~8 minutes on 2 cores
    python scripts/families_sweep.py --families llama,qwen3_5 --jobs 2   # a few
    python scripts/families_sweep.py --list                               # the families it would run

`--families NAME --jobs 1` reruns one family; its JSON entry has each error and the last lines of its traceback.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import platform
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the library of this checkout
sys.path.insert(1, str(REPO / "tests" / "gpu"))  # _gpu_models: the tests' tiny configs and checkpointing switch

import torch  # noqa: E402
import transformers  # noqa: E402
from _gpu_models import enable_checkpointing, model_config  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload import InfeasibleBudgetError, get_act_offloading_ctx_manager  # noqa: E402
from hf_offload.memory_budget import probes  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128
VOCAB = 256
LAYERS, MAX_LAYERS = 2, 8  # more only where a per-layer list needs them to hold every kind of layer
EXPERTS, TOP_K = 4, 2
BATCH, SEQ = 2, 48  # 96 tokens a step: one and a half times the hidden size, so an MLP or a layer tiles in two chunks
LONG_SEQ = 4 * SEQ  # the cold run's steps
PROBE_TOKENS = 40  # the cold run's probes (`probes.PROBE_MAX_TOKENS`): the first 20 tokens of each sequence
STEPS, COLD_STEPS = 6, 4  # 6: two profiled steps, three of the closed loop's trial, then the plan's own
ROOMY = 10 * 2**30
# Kept apart from every size above: the probes cut a long step's arguments along each dimension as long as the sequence.
assert len({SEQ, LONG_SEQ, PROBE_TOKENS // BATCH} & {HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB}) == 0

# The families whose tiny config the tests already build (`tests/gpu/_gpu_models.model_config`), by their names there.
TEST_CONFIGS = ("llama", "qwen2", "gpt2", "mistral", "gemma2", "phi", "bart", "bert", "gemma3", "mixtral", "qwen3_moe",
                "gpt_oss", "deepseek_v32", "jamba", "qwen3_next", "bamba", "falcon_h1")  # fmt: skip

# ----------------------------------------------------------------------------------------------------------------------
# Tiny configs
# ----------------------------------------------------------------------------------------------------------------------

# Config fields by what they size, under the names transformers' configs give them. A field is only ever shrunk.
_HIDDEN = {"hidden_size", "n_embd", "d_model", "emb_dim", "embed_dim", "dim", "word_embed_proj_dim", "embedding_size",
           "embedding_dim", "input_embedding_size", "output_embedding_size", "attention_hidden_size", "lru_width",
           "backbone_hidden_size", "hidden_dim", "adapter_in_dim", "adapter_input_size",
           "adapter_out_dim"}  # fmt: skip
_LAYERS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
           "num_decoder_layers", "num_encoder_layers"}  # fmt: skip
_HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
          "encoder_attention_heads", "swa_num_attention_heads"}  # fmt: skip
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "swa_num_key_value_heads"}
_HEAD_DIMS = {"head_dim", "d_head", "dim_head", "attention_head_size", "attention_head_dim", "kv_channels",
              "swa_head_dim", "d_kv", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
              "index_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim"}  # fmt: skip
_SMALL = {"qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "rotary_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 32,
          "o_lora_rank": 16, "index_topk": 8, "index_n_heads": 2, "index_num_heads": 1, "index_block_size": 8,
          "index_pool_size": 16, "index_num_local_tokens": 8, "mamba_d_state": 8, "ssm_state_size": 8,
          "state_size": 8, "d_state": 8, "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_chunk_size": 16,
          "chunk_size": 16, "mamba_dt_rank": 8, "time_step_rank": 8, "mamba_n_groups": 1, "n_groups": 1, "n_group": 1,
          "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1, "hidden_size_per_layer_input": 16,
          "laurel_rank": 8, "router_hidden_size": 32, "loop_gate_rank": 8, "adapter_rank": 8, "prompt_length": 4,
          "prompt_mid_dim": 32, "num_centroids": 16, "zero_expert_num": 2, "linear_num_key_heads": 2}  # fmt: skip
_INTERMEDIATE = {"intermediate_size", "n_inner", "ffn_dim", "d_ff", "dff", "d_inner", "decoder_ffn_dim",
                 "encoder_ffn_dim", "ffn_hidden_size", "dim_ff", "feed_forward_size", "intermediate_size_mlp",
                 "first_dense_intermediate_size", "dense_intermediate_size", "mlp_only_intermediate_size"}  # fmt: skip
_EXPERT_INTERMEDIATE = {"moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                        "expert_ffn_hidden_size", "moe_shared_expert_intermediate_size"}  # fmt: skip
_VOCABS = {"vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size",
           "ngram_vocab_size_base", "pronunciation_vocab_size", "shape_vocab_size"}  # fmt: skip
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k"}
_WINDOWS = {"sliding_window", "window_size", "attention_window_size", "sliding_window_size", "attention_chunk_size",
            "local_attention_window_len", "local_attention", "rel_extent"}  # fmt: skip
WINDOW = 16  # shorter than the steps, so that the sliding-window masks are really used
_POSITIONS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length",
              "max_target_positions", "model_max_length", "original_max_position_embeddings"}  # fmt: skip
POSITIONS = 1024
_DROPOUT = re.compile(r"dropout|pdrop|drop_rate|layerdrop|drop_path")
_TOKEN_ID = re.compile(r"(token_id|token_ids|token_index|_token)$")

# What some families need besides, merged into the shrunk config's fields (keys of sub-configs as "text_config.x").
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8, "head_dim": 16},  # num_heads x head_dim = expand x hidden_size
    "doge": {"num_experts": 16, "num_experts_per_tok": 2},  # product-key experts: a square number
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # a pattern and its repeat count, per pair of layers
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # no default
    # The last `num_kv_shared_layers` reuse the keys and values of the last earlier layer of their kind.
    "gemma3n_text": {"num_hidden_layers": 8, "num_kv_shared_layers": 3},
    # Its default refuses itself
    "gemma4_assistant": {"text_config.hidden_size_per_layer_input": 0, "text_config.vocab_size_per_layer_input": 0},
    # Rotary parameters per kind of layer: the default has one set for all.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # Input, recurrent and output layers, each sliding-window attention but every fourth
    "dory": {
        "num_hidden_layers": 4,
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    },
    # The sparse attention's indexer, which the default leaves unset
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
    # Training needs the axial position shape's product to be the sequence's length
    "reformer": {
        "axial_pos_embds_dim": [32, 32],
        "axial_pos_shape": [8, SEQ // 8],
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
        "max_position_embeddings": SEQ,
    },
    "xmod": {"default_language": "en_XX"},
    "zamba": {"num_hidden_layers": 8},  # two of its hybrid layers, which share a block
}
OVERRIDES["qwen4_exp"] = {f"text_config.{name}": value for name, value in OVERRIDES["qwen4_exp_text"].items()}


def tiny_config(family: str) -> transformers.PreTrainedConfig:
    """The family's config at a tiny size: the tests' own where they have one, else its default config shrunk."""
    if family in TEST_CONFIGS:
        config = model_config(family, hidden=HIDDEN, layers=LAYERS, seq=SEQ, vocab=VOCAB, attn=None)
        for name, value in _adjustments(config.to_dict()).items():
            _set_nested(config, name, value)
        return config
    config_class = CONFIG_MAPPING[family]
    try:
        default = config_class()
    except Exception:  # a default the family's own validation refuses: with its overrides
        default = config_class(**_nested(OVERRIDES.get(family, {})))
    defaults, overrides = default.to_dict(), OVERRIDES.get(family, {})
    fields = _shrunk(defaults, next((overrides[name] for name in _LAYERS if name in overrides), None))
    _merge(fields, _nested(_adjustments(defaults)), defaults)
    _merge(fields, _nested(overrides), defaults)
    _remap_token_ids(fields, defaults)
    return config_class(**fields)


def _shrunk(fields: dict[str, Any], layers_wanted: int | None = None) -> dict[str, Any]:
    """The fields of a config (`to_dict()`) that change at the tiny size (sub-configs: theirs, and their model type);
    `layers_wanted` where a family's overrides name its layers."""
    changed: dict[str, Any] = {}
    layers = _layer_count(fields)
    if layers is not None and layers_wanted is not None:
        layers = (layers[0], layers_wanted)
    for name, value in fields.items():
        if name == "per_layer_config" and isinstance(value, dict):  # overrides by layer index (Gemma 4)
            kept = {key: {**sub, **_shrunk(sub)} for key, sub in value.items()
                    if layers is None or int(key) < layers[1]}  # fmt: skip
            if kept != value:
                changed[name] = kept
            continue
        if isinstance(value, dict) and (name.endswith("_config") or "model_type" in value):
            sub = _shrunk(value)  # the sub-config's other fields keep their defaults
            if sub:
                changed[name] = {**({"model_type": value["model_type"]} if "model_type" in value else {}), **sub}
            continue
        new = _shrink_field(name, value, fields, layers)
        if new is not _SAME and new != value:
            changed[name] = new
    if "qk_nope_head_dim" in fields and "qk_rope_head_dim" in fields:  # multi-head latent attention
        rope = changed.get("qk_rope_head_dim", fields["qk_rope_head_dim"])
        if "qk_head_dim" in fields:
            changed["qk_head_dim"] = changed.get("qk_nope_head_dim", fields["qk_nope_head_dim"]) + rope
        if fields.get("head_dim") == fields["qk_rope_head_dim"]:  # the rotary part's, as DeepSeek-V3 has it
            changed["head_dim"] = rope
    heads = [name for name in _HEADS if isinstance(fields.get(name), int)]
    if heads:  # where a default leaves them to the checkpoint's config
        changed.update({name: HEAD_DIM for name in ("head_dim",) if name in fields and fields[name] is None})
        changed.update({name: KV_HEADS for name in _KV_HEADS if name in fields and fields[name] is None})
    if any(fields.get(name) for name in _EXPERT_INTERMEDIATE):  # experts, where a default leaves their count unset
        changed.update({name: EXPERTS for name in _EXPERTS if name in fields and fields[name] is None})
        changed.update({name: TOP_K for name in _TOP_K if name in fields and fields[name] is None})
        changed.update({name: 1 for name in ("n_shared_experts",) if name in fields and fields[name] is None})
    return changed


_SAME = object()


def _shrink_field(name: str, value: Any, fields: dict[str, Any], layers: tuple[int, int] | None) -> Any:
    if isinstance(value, list) and layers is not None:
        return _shrink_list(name, value, layers)
    if not isinstance(value, int) or isinstance(value, bool):
        return _SAME
    hidden = next((fields[key] for key in ("hidden_size", "n_embd", "d_model") if isinstance(fields.get(key), int)), 0)
    if name in _LAYERS:
        return layers[1] if layers is not None else min(value, LAYERS)
    if name in _HIDDEN:
        # Zamba's attention is twice as wide as its hidden states
        ratio = value // hidden if name == "attention_hidden_size" and hidden and value % hidden == 0 else 1
        return min(value, HIDDEN * min(ratio, 4))
    if name in _HEADS:
        return min(value, HEADS)
    if name in _KV_HEADS:
        heads = next((fields[key] for key in _HEADS if isinstance(fields.get(key), int)), None)
        return min(value, HEADS if value == heads else KV_HEADS)
    if name in _HEAD_DIMS:
        return min(value, HEAD_DIM)
    if name == "linear_num_value_heads":
        keys = fields.get("linear_num_key_heads") or value
        return min(value, 2 * max(1, min(value // keys, 4)))
    if name in _SMALL:
        return min(value, _SMALL[name])
    if name in _INTERMEDIATE:
        return min(value, INTERMEDIATE)
    if name in _EXPERT_INTERMEDIATE:
        return min(value, INTERMEDIATE // 2)
    if name in _VOCABS:
        return min(value, VOCAB)
    if name in _EXPERTS:
        return min(value, EXPERTS)
    if name in _TOP_K:
        return min(value, TOP_K)
    if name in _WINDOWS:
        return min(value, WINDOW)
    if name in _POSITIONS:
        return min(value, POSITIONS)
    return _SAME


def _layer_count(fields: dict[str, Any]) -> tuple[int, int] | None:
    """(the default's layers, the tiny config's): the fewest layers, at least `LAYERS`, whose per-layer lists hold
    every kind of layer the default's do (Qwen3.5's three linear-attention layers and a full one: 4), at most
    `MAX_LAYERS`. None where the config has no layer count of its own (a composite's)."""
    counts = [fields[name] for name in _LAYERS if isinstance(fields.get(name), int)]
    if not counts:
        return None
    default = max(counts)
    needed = LAYERS
    for value in fields.values():
        if not isinstance(value, list) or not value:
            continue
        if len(value) == default:  # one entry a layer: every kind of entry
            kinds = {json.dumps(entry, sort_keys=True) for entry in value}
            seen: set[str] = set()
            for index, entry in enumerate(value):
                seen.add(json.dumps(entry, sort_keys=True))
                if seen == kinds:
                    needed = max(needed, index + 1)
                    break
        elif _is_index_list(value, default):  # the indices of some layers: one of them, and one other
            members = set(value)
            first_other = next(i for i in range(default) if i not in members)
            needed = max(needed, min(value) + 1, first_other + 1)
    return default, min(needed, MAX_LAYERS)


def _is_index_list(value: list, layers: int) -> bool:
    return (len(value) < layers and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and value == sorted(set(value)) and value[-1] < layers)  # fmt: skip


def _shrink_list(name: str, value: list, layers: tuple[int, int]) -> Any:
    default, tiny = layers
    if not value or default == tiny:
        return _SAME
    if len(value) == default:
        cut = value[:tiny]
        if name in _INTERMEDIATE:  # one intermediate size a layer (Gemma 3n)
            cut = [min(v, INTERMEDIATE) for v in cut]
        return cut
    if _is_index_list(value, default):
        return [v for v in value if v < tiny]
    return _SAME


def _adjustments(fields: dict[str, Any]) -> dict[str, Any]:
    """What every tiny config sets whatever its size: no dropout, the routers' logits on (the MoE auxiliary loss), a
    decoder where the family's model can be an encoder (BERT-like: causal attention). Sub-configs as "name.field"."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, dict) and (name.endswith("_config") or "model_type" in value):
            out.update({f"{name}.{key}": sub for key, sub in _adjustments(value).items()})
        elif _DROPOUT.search(name) and isinstance(value, float) and value > 0:
            out[name] = 0.0
        elif name in ("output_router_logits", "is_decoder") and value is False:
            out[name] = True
    return out


def _remap_token_ids(fields: dict[str, Any], default: dict[str, Any]) -> None:
    """Token ids beyond the tiny vocabulary (special tokens, image tokens) moved to its top, in place: equal ids stay
    equal (a `bos_token_id` that is the `eos_token_id`)."""
    new_ids: dict[int, int] = {}

    def remap(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            return new_ids.setdefault(value, VOCAB - 1 - len(new_ids))
        if isinstance(value, list):
            return [remap(v) for v in value]
        return value

    def walk(current: dict[str, Any], original: dict[str, Any]) -> None:
        for name, value in original.items():
            if not isinstance(name, str) or name in ("id2label", "label2id", "per_layer_config"):
                continue
            if isinstance(value, dict):
                sub = current.get(name, {})
                if isinstance(sub, dict):
                    walk(sub, value)
                    if sub and name not in current:  # a sub-config that kept its defaults but for its token ids
                        current[name] = {**({"model_type": value["model_type"]} if "model_type" in value else {}),
                                         **sub}  # fmt: skip
            elif _TOKEN_ID.search(name):
                new = remap(current.get(name, value))
                if new != value:
                    current[name] = new

    walk(fields, default)


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """{"text_config.x": 1} as {"text_config": {"x": 1}}."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        target = out
        for part in path:
            target = target.setdefault(part, {})
        target[last] = value
    return out


def _merge(into: dict[str, Any], extra: dict[str, Any], defaults: dict[str, Any]) -> None:
    """`extra` merged into `into`, sub-config by sub-config; a sub-config `into` lacks is added with the model type
    `defaults` give it (an `AutoConfig` sub-config needs it)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            if key not in into:
                into[key] = {"model_type": defaults[key]["model_type"]} if "model_type" in defaults[key] else {}
            _merge(into[key], value, defaults[key])
        else:
            into[key] = value


def _set_nested(config: Any, name: str, value: Any) -> None:
    *path, last = name.split(".")
    for part in path:
        config = getattr(config, part)
    setattr(config, last, value)


def _dropout_left(fields: dict[str, Any], prefix: str = "") -> list[str]:
    """The dropout probabilities above 0 in a config's fields, its sub-configs' included."""
    left = []
    for name, value in fields.items():
        if not isinstance(name, str):
            continue
        if isinstance(value, dict):
            left += _dropout_left(value, f"{prefix}{name}.")
        elif _DROPOUT.search(name) and isinstance(value, float) and value > 0:
            left.append(f"{prefix}{name}={value}")
    return left


def special_token_ids(config: Any) -> set[int]:
    """Every token id the config names, in it or its sub-configs: the inputs draw none of them."""
    ids: set[int] = set()

    def walk(fields: dict[str, Any]) -> None:
        for name, value in fields.items():
            if not isinstance(name, str) or name in ("id2label", "label2id"):
                continue
            if isinstance(value, dict):
                walk(value)
            elif _TOKEN_ID.search(name):
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, int) and not isinstance(v, bool):
                        ids.add(v)

    walk(config.to_dict())
    return ids


def vocabulary(config: Any) -> int:
    """The vocabulary the input ids are drawn from: the text model's."""
    for candidate in (config, getattr(config, "text_config", None), getattr(config, "get_text_config", lambda: None)()):
        size = getattr(candidate, "vocab_size", None)
        if isinstance(size, int):
            return size
    return VOCAB


# ----------------------------------------------------------------------------------------------------------------------
# Training steps
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Steps:
    """What a run of AdamW steps left, per step: the loss and every gradient; with a context under a memory budget, the
    codes of the plans its layers ran; with a reference model run in lockstep, how the step's loss and gradients
    differ from the reference's at the same weights (None where they are equal bit for bit; the largest relative
    difference), so that a tiled step's difference is its own and not the optimizer's amplification of an earlier
    one."""

    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    plans: list[list[str]] = dataclasses.field(default_factory=list)
    differences: list[str | None] = dataclasses.field(default_factory=list)
    relative: list[float] = dataclasses.field(default_factory=list)
    bytes_offloaded: int = 0
    kept: dict[str, int] = dataclasses.field(default_factory=dict)  # the bytes the last step kept, by reason

    def tiled(self, step: int) -> bool:
        """Whether a plan the step ran tiled a layer or its MLP (`T`, `t`, `L`, `l`)."""
        return any(letter in "TtLl" for code in self.plans[step] for letter in code) if self.plans else False


class ReferenceFailed(Exception):
    """The lockstep reference, without hf-offload, failed: not the library's doing."""


def batches(config: Any, seq: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """One batch a step, of ids the config names for no special token; the labels ignore the first 4 positions."""
    excluded = special_token_ids(config)
    allowed = torch.tensor([i for i in range(min(vocabulary(config), VOCAB)) if i not in excluded])
    generator = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        ids = allowed[torch.randint(len(allowed), (BATCH, seq), generator=generator)]
        labels = ids.clone()
        labels[:, :4] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def train(model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]], context: Any = None,
          extra: dict[str, Any] | None = None, reference: torch.nn.Module | None = None) -> Steps:  # fmt: skip
    """AdamW steps, one a batch, the context (if any) around each forward as the Trainer's `compute_loss` has it. Each
    forward is seeded the same, so that a run and its reference draw the same random numbers. With `reference`, that
    model is given this one's weights before each step and runs the step without hf-offload, for comparison."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    extra = extra or {}
    result = Steps()
    watch = _PlanWatch(model, context)
    try:
        for step, batch in enumerate(inputs):
            if reference is not None:
                reference.load_state_dict(model.state_dict())
                reference.zero_grad(set_to_none=True)
                torch.manual_seed(100 + step)
                try:
                    reference_loss = reference(**batch, **extra).loss
                    reference_loss.backward()
                except Exception as error:
                    raise ReferenceFailed(short_error(error)) from error
                reference_grads = _gradients(reference)
            torch.manual_seed(100 + step)
            optimizer.zero_grad(set_to_none=True)
            watch.codes = []
            if context is None:
                loss = model(**batch, **extra).loss
            else:
                with context:
                    loss = model(**batch, **extra).loss
            loss.backward()
            result.losses.append(loss.detach().clone())
            result.grads.append(_gradients(model))
            if context is not None:
                stats = context.get_stats()
                result.bytes_offloaded += stats.get("bytes_offloaded", 0)
                result.kept = {name.removeprefix("bytes_kept_"): value for name, value in stats.items()
                               if name.startswith("bytes_kept_") and value}  # fmt: skip
                result.plans.append(watch.codes)
            if reference is not None:
                difference, relative = compare(result.losses[-1], result.grads[-1], reference_loss.detach(),
                                               reference_grads)  # fmt: skip
                result.differences.append(difference)
                result.relative.append(relative)
            optimizer.step()
    finally:
        watch.remove()
    return result


class _PlanWatch:
    """The codes of the plans the decoder layers run under, read as each layer starts (after the context's own
    pre-hook, which may apply a plan there). Probe calls are seen too: a plan replaced inside the first layer's
    pre-hook counts as run, which can only relax the bitwise check."""

    def __init__(self, model: torch.nn.Module, context: Any) -> None:
        from hf_offload.model import find_decoder_layers, unwrap_model

        self.codes: list[str] = []
        self.planner = getattr(getattr(context, "budget_controller", None), "planner", None)
        layers = find_decoder_layers(unwrap_model(model)) if self.planner is not None else []
        self.handles = [layer.register_forward_pre_hook(self._seen) for _, layer in layers]

    def _seen(self, layer: torch.nn.Module, args: Any) -> None:
        code = self.planner.code
        if code and (not self.codes or self.codes[-1] != code):
            self.codes.append(code)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def compare(loss: torch.Tensor, grads: dict[str, torch.Tensor], reference_loss: torch.Tensor,
            reference_grads: dict[str, torch.Tensor]) -> tuple[str | None, float]:  # fmt: skip
    """What differs first (None where the loss and every gradient are equal bit for bit), and the largest relative
    difference: `max |a - b| / max |b|` over the loss and each gradient, `max |b|` floored at `NOISE_FLOOR` of the
    largest gradient's, so that a gradient that is zero but for rounding (a key projection's bias, under a softmax
    that ignores it) does not count as differing by its whole size."""
    if grads.keys() != reference_grads.keys():
        return f"gradients of different parameters ({sorted(grads.keys() ^ reference_grads.keys())[:3]})", math.inf
    pairs = [("loss", loss, reference_loss)] + [(name, grads[name], reference_grads[name]) for name in grads]
    largest = max((want.double().abs().max().item() for _, _, want in pairs[1:] if want.numel()), default=0.0)
    first, worst = None, 0.0
    for name, got, want in pairs:
        if torch.equal(got, want):
            continue
        if got.shape != want.shape:
            return f"{name}: shape {tuple(got.shape)} against {tuple(want.shape)}", math.inf
        difference = (got.double() - want.double()).abs().max().item()
        scale = max(want.double().abs().max().item(), NOISE_FLOOR * largest if name != "loss" else 0.0, 1e-30)
        if difference / scale > worst:
            worst = difference / scale
            first = f"{name}: max |diff| {difference:.3g} of {scale:.3g}"
        first = first or f"{name}: max |diff| {difference:.3g}"
    return first, worst


NOISE_FLOOR = 1e-6


def bitwise_equal(a: Steps, b: Steps) -> str | None:
    """None where every loss and gradient of every step of two runs is equal bit for bit, else what differs first."""
    if len(a.losses) != len(b.losses):
        return f"{len(a.losses)} steps against {len(b.losses)}"
    for step, (la, lb, ga, gb) in enumerate(zip(a.losses, b.losses, a.grads, b.grads), 1):
        difference = compare(la, ga, lb, gb)[0]
        if difference is not None:
            return f"step {step}: {difference}"
    return None


# ----------------------------------------------------------------------------------------------------------------------
# One family
# ----------------------------------------------------------------------------------------------------------------------

CASES = ("roomy", "halfway", "minimum", "cold")
# How far a step's gradients may be from the reference's at the same weights, relative to each gradient's scale,
# where a plan tiled a layer: tiling sums weight gradients chunk by chunk, which in float32 lands within 1e-5
# (tests/tiled/), a few 1e-5 where the layer is not exact under recomputing either (Qwen3.5's linear attention). Far
# more is a wrong result, not rounding. Steps that tiled nothing must be bitwise equal.
TILED_TOLERANCE = 1e-3
# What the library refuses by design, up front and saying why: a family it refuses so is not failing it.
REFUSALS = (re.compile(r"memory_budget needs a transformers model with decoder layers"),)


def short_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def traceback_tail(error: BaseException, lines: int = 12) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__)[-lines:])


class _Warnings(logging.Handler):
    """hf-offload's warnings during a family's checks, each distinct one once (numbers aside)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().split("\n")[0]
        if re.match(r"hf_offload: memory_budget=\d+ .* is set, so hf-offload decides", message):
            return  # said by every run under a budget
        key = re.sub(r"\d+(\.\d+)?", "#", message)
        if key not in self.seen and len(self.messages) < 10:
            self.seen.add(key)
            self.messages.append(message[:300])


def check_family(family: str, report: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Every check of one family (see the module docstring); `report` is given the result as each phase ends, so that
    a timeout or a crash leaves what was learned before it, and the phase it happened in."""
    result: dict[str, Any] = {"family": family, "phase": "build", "notes": [], "cases": {}}
    started = time.perf_counter()

    def phase(name: str) -> None:
        result["seconds"] = round(time.perf_counter() - started, 1)
        result["phase"] = name
        report(result)

    phase("build")
    try:
        config = tiny_config(family)
        torch.manual_seed(0)
        pristine = transformers.AutoModelForCausalLM.from_config(config).train()
    except Exception as error:
        result["built"] = short_error(error)
        result["traceback"] = traceback_tail(error)
        phase("done")
        return result
    result["built"] = True
    result["model_class"] = type(pristine).__name__
    result["parameters"] = sum(p.numel() for p in pristine.parameters())
    result["layers"] = getattr(config.get_text_config(), "num_hidden_layers", None)
    dropout = _dropout_left(config.to_dict())
    if dropout:  # tiling draws dropout masks chunk by chunk: a tiled step then differs by more than rounding
        result["notes"].append(f"dropout left on: {', '.join(dropout)}")

    def fresh(checkpointing: bool = False) -> torch.nn.Module:
        model = copy.deepcopy(pristine)
        if checkpointing:
            enable_checkpointing(model, "nonreentrant")
        return model

    short = batches(config, SEQ, STEPS)
    extra: dict[str, Any] = {}

    # The baseline, twice: a family that does not train without hf-offload is not ours to judge.
    phase("baseline")
    try:
        try:
            baseline = train(fresh(), short)
        except Exception as error:  # as a user would next: without a cache, which some families build in training
            baseline = train(fresh(), short, extra={"use_cache": False})
            extra = {"use_cache": False}
            result["notes"].append(f"trains only with use_cache=False ({short_error(error)[:120]})")
        repeat = train(fresh(), short, extra=extra)
    except Exception as error:
        result["baseline"] = short_error(error)
        result["traceback"] = traceback_tail(error)
        phase("done")
        return result
    difference = bitwise_equal(repeat, baseline)
    result["baseline"] = "ok" if difference is None else f"does not repeat: {difference}"

    # Checkpointing without hf-offload: the bitwise check's reference, and whether recomputing is exact here (the
    # budget's plans checkpoint layers, and are compared with steps that do not).
    phase("checkpointing")
    try:
        checkpointed = train(fresh(checkpointing=True), short, extra=extra)
        difference = bitwise_equal(checkpointed, baseline)
        if difference is not None and not extra:
            # Checkpointing turns transformers' cache off, and some families compute otherwise with it on in training
            # (Qwen3.5's linear attention, Falcon-H1's Mamba): compared without it, they can be held bitwise.
            without_cache = train(fresh(), short, extra={"use_cache": False})
            if bitwise_equal(checkpointed, without_cache) is None:
                baseline, extra, difference = without_cache, {"use_cache": False}, None
                result["notes"].append("trains otherwise with use_cache=True, which checkpointing turns off: every "
                                       "run compared with use_cache=False")  # fmt: skip
        result["checkpointing"] = "exact" if difference is None else f"not bitwise (transformers): {difference}"
    except ValueError as error:  # the family cannot checkpoint (supports_gradient_checkpointing is False)
        checkpointed, result["checkpointing"] = None, f"unsupported: {short_error(error)[:150]}"
    except Exception as error:
        checkpointed, result["checkpointing"] = None, f"fails without hf-offload: {short_error(error)}"

    handler = _Warnings()
    library_logger = logging.getLogger("hf_offload")
    library_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:  # the library's Python warnings, among transformers'
            warnings.simplefilter("always")
            try:
                phase("bitwise")
                result["bitwise"] = _check_offloading(fresh, short, extra, baseline, checkpointed, result)
                _check_budgets(fresh, config, short, extra, result, phase)
            finally:
                library = str(Path(hf_offload.__file__).parent)
                for warning in caught:
                    if str(warning.message).startswith("hf_offload") or warning.filename.startswith(library):
                        handler.emit(logging.makeLogRecord({"msg": str(warning.message), "levelno": logging.WARNING}))
    finally:
        library_logger.removeHandler(handler)
        result["warnings"] = handler.messages
    phase("done")
    return result


def _check_offloading(fresh: Callable[..., torch.nn.Module], short: list, extra: dict, baseline: Steps,
                      checkpointed: Steps | None, result: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Offloading with non-reentrant checkpointing against checkpointing alone; offloading alone against the baseline
    where the family cannot checkpoint."""
    with_checkpointing = result["checkpointing"] == "exact" or result["checkpointing"].startswith("not bitwise")
    reference = checkpointed if with_checkpointing else baseline
    model = fresh(checkpointing=with_checkpointing)
    try:
        context = get_act_offloading_ctx_manager(model, device_type="cpu")
        try:
            got = train(model, short, context, extra)
        finally:
            context.remove_hooks()
    except Exception as error:
        return {"ok": False, "error": short_error(error), "traceback": traceback_tail(error)}
    out: dict[str, Any] = {"checkpointing": with_checkpointing, "bytes_offloaded": got.bytes_offloaded}
    difference = bitwise_equal(got, reference)
    if result["baseline"] != "ok":
        out.update(ok=None, error=f"not compared: the baseline does not repeat ({difference or 'equal here'})")
    elif difference is not None:
        out.update(ok=False, error=f"not bitwise: {difference}")
    elif got.bytes_offloaded == 0:  # equal, trivially: with checkpointing, every layer's input should move
        kept = ", ".join(f"{reason} {size} bytes" for reason, size in got.kept.items())
        out.update(ok=False, error=f"offloading moved no bytes; the last step kept {kept or 'nothing'}")
    else:
        out["ok"] = True
    return out


def _check_budgets(fresh: Callable[..., torch.nn.Module], config: Any, short: list, extra: dict,
                   result: dict[str, Any], phase: Callable[[str], None]) -> None:  # fmt: skip
    """The budget's four cases (see the module docstring), each on a fresh model with a reference run in lockstep."""
    cases = result["cases"]
    # Where recomputing a layer is not exact without hf-offload, or the baseline does not repeat, a checkpointed
    # layer's step cannot be bitwise: its differences are reported, not held against the library.
    exact = result["baseline"] == "ok" and result["checkpointing"] == "exact"

    def refused(case: dict[str, Any], error: BaseException) -> bool:
        if any(pattern.search(str(error)) for pattern in REFUSALS):
            case.update(ok=None, error=f"refused: {short_error(error)}")
            return True
        if isinstance(error, ReferenceFailed):
            case.update(ok=None, error=f"fails without hf-offload: {error}")
            return True
        return False

    def run(name: str, budget: int, inputs: list) -> None:
        phase(name)
        case: dict[str, Any] = {"budget": budget}
        cases[name] = case
        model = fresh()
        try:
            context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
            try:
                got = train(model, inputs, context, extra, reference=fresh())
                plan = context.memory_plan
                case["plan"] = plan.code if plan is not None else None
                case["predicted_peak"] = plan.predicted.peak_bytes if plan is not None else None
            finally:
                context.remove_hooks()
        except Exception as error:
            if not refused(case, error):
                case.update(ok=False, error=short_error(error), traceback=traceback_tail(error))
            return
        case["ok"] = True
        codes = [code for step in got.plans for code in step]
        case["plans"] = [code for index, code in enumerate(codes) if index == 0 or codes[index - 1] != code]
        case["tiled_steps"] = [step + 1 for step in range(len(inputs)) if got.tiled(step)]
        case["grad_diff_per_step"] = got.relative
        case["max_grad_diff"] = max(got.relative)
        untiled = [(step + 1, got.differences[step]) for step in range(len(inputs))
                   if got.differences[step] is not None and not got.tiled(step)]  # fmt: skip
        if untiled:
            step, difference = untiled[0]
            message = f"not bitwise at step {step}, which tiled no layer (plans {got.plans[step - 1]}): {difference}"
            if exact:
                case.update(ok=False, error=message)
            else:
                case["note"] = message
        worst = max(range(len(inputs)), key=lambda step: got.relative[step])
        if case["ok"] and got.relative[worst] > TILED_TOLERANCE:
            case.update(ok=False, error=f"step {worst + 1} (plans {got.plans[worst]}) differs by "
                                        f"{got.relative[worst]:.3g} of the gradient's scale, more than "
                                        f"{TILED_TOLERANCE:g}: {got.differences[worst]}")  # fmt: skip

    def minimum(name: str, inputs: list) -> int | None:
        """The smallest budget that works, as a budget of 1 byte's refusal names it."""
        phase(f"{name} (refusal)")
        case: dict[str, Any] = {"budget": 1}
        try:
            model = fresh()
            context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=1)
            try:
                train(model, inputs, context, extra)
            finally:
                context.remove_hooks()
        except InfeasibleBudgetError as error:
            return error.minimum_bytes
        except Exception as error:
            if not refused(case, error):
                case.update(
                    ok=False, error=f"a budget of 1 byte: {short_error(error)}", traceback=traceback_tail(error)
                )
            cases[name] = case
            return None
        cases[name] = {**case, "ok": False, "error": "a budget of 1 byte was not refused"}
        return None

    run("roomy", ROOMY, short)
    least = minimum("minimum", short)
    if least is not None:
        run("minimum", least, short)
    roomy_peak = cases["roomy"].get("predicted_peak")
    if least is None or not roomy_peak:
        cases["halfway"] = {"ok": None, "error": "no budget: needs the roomy plan's peak and the minimum"}
    elif roomy_peak <= least:  # static memory sets every plan's peak: the minimum's margin covers them all
        cases["halfway"] = {"ok": None, "error": f"no budget between: the roomy plan's peak ({roomy_peak} bytes) is "
                                                 f"not above the minimum ({least})"}  # fmt: skip
    else:
        run("halfway", (least + roomy_peak) // 2, short)

    # A cold long first step: every step 4x as long, the probes cut to `PROBE_TOKENS` of it.
    default_probe_tokens = probes.PROBE_MAX_TOKENS
    probes.PROBE_MAX_TOKENS = PROBE_TOKENS
    try:
        long = batches(config, LONG_SEQ, COLD_STEPS)
        try:
            train(fresh(), long[:1], extra=extra)
        except Exception as error:
            cases["cold"] = {"ok": None, "error": f"long steps fail without hf-offload: {short_error(error)}"}
            return
        least = minimum("cold", long)
        if least is not None:
            run("cold", least, long)
    finally:
        probes.PROBE_MAX_TOKENS = default_probe_tokens


# ----------------------------------------------------------------------------------------------------------------------
# Verdicts
# ----------------------------------------------------------------------------------------------------------------------

PASS, FAIL, NO_CONFIG, TRANSFORMERS_FAILS = "pass", "FAIL", "no-config", "transformers-fails"
_TRANSFORMERS_PHASES = ("start", "build", "baseline", "checkpointing")


def verdict(result: dict[str, Any]) -> tuple[str, list[str]]:
    """The family's status and, where it failed on hf-offload's account, why (one line per check)."""
    if result.get("harness_error"):
        return FAIL, [f"the sweep itself: {result['harness_error']}"]
    if result.get("built") is not True:
        return NO_CONFIG, []
    if "baseline" not in result or not (result["baseline"] == "ok" or result["baseline"].startswith("does not")):
        return TRANSFORMERS_FAILS, []
    if result.get("ended") is not None and result.get("phase") in _TRANSFORMERS_PHASES:
        return TRANSFORMERS_FAILS, []  # cut short while training without hf-offload
    failures = []
    if (result.get("bitwise") or {}).get("ok") is False:
        failures.append(f"bitwise: {result['bitwise']['error']}")
    # Where checkpointing fails without hf-offload, so do the plans that checkpoint: not the library's doing.
    checkpointing_fails = result.get("checkpointing", "").startswith("fails")
    for name in CASES:
        case = result["cases"].get(name, {})
        if case.get("ok") is False and not checkpointing_fails:
            failures.append(f"{name}: {case['error']}")
    if result.get("ended") is not None and result.get("phase") not in _TRANSFORMERS_PHASES:
        failures.append(f"{result['phase']}: {result['ended']}")  # a timeout or a crash in a check of the library
    return (FAIL if failures else PASS), failures


def _with_ending(result: dict[str, Any], ended: str) -> dict[str, Any]:
    """A result cut short: the phase it was in says whose account it is on."""
    result = dict(result, ended=ended)
    if result.get("phase") == "build":
        result["built"] = f"{ended} while building"
    elif result.get("phase") == "baseline":
        result["baseline"] = f"{ended} in the baseline"
    elif result.get("phase") == "checkpointing":
        result["checkpointing"] = f"{ended} without hf-offload"
    return result


# ----------------------------------------------------------------------------------------------------------------------
# Worker processes
# ----------------------------------------------------------------------------------------------------------------------


def _worker(family: str, connection: Connection) -> None:
    """One family, in a process forked from the sweep's: each phase's result goes back through `connection`."""
    torch.set_num_threads(1)  # one process a core: --jobs of them run side by side
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    library_logger = logging.getLogger("hf_offload")
    library_logger.setLevel(logging.WARNING)
    library_logger.propagate = False
    library_logger.handlers = [logging.NullHandler()]
    result: dict[str, Any] = {"family": family, "phase": "start", "notes": [], "cases": {}}

    def report(current: dict[str, Any]) -> None:
        result.update(current)
        connection.send(json.loads(json.dumps(current, default=str)))

    try:
        check_family(family, report)
    except BaseException as error:  # a defect of the sweep itself: reported, and counted as a failure
        report({**result, "harness_error": short_error(error), "traceback": traceback_tail(error), "phase": "done"})
    connection.close()


def run_sweep(families: list[str], jobs: int, timeout: float,
              progress: Callable[[dict[str, Any]], None] = lambda result: None) -> list[dict[str, Any]]:  # fmt: skip
    """Every family in a forked worker, `jobs` at a time, each killed after `timeout` seconds; the results in the
    families' order, each with its `status` and `failures`."""
    context = multiprocessing.get_context("fork")
    pending, running, results = list(families), {}, {}

    def finish(connection: Connection, result: dict[str, Any]) -> None:
        family, process, started, _ = running.pop(connection)
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
        connection.close()
        result.setdefault("seconds", round(time.monotonic() - started, 1))
        result["wall_seconds"] = round(time.monotonic() - started, 1)
        result["status"], result["failures"] = verdict(result)
        results[family] = result
        progress(result)

    while pending or running:
        while pending and len(running) < jobs:
            family = pending.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_worker, args=(family, sender), name=f"sweep-{family}", daemon=True)
            process.start()
            sender.close()
            running[receiver] = [family, process, time.monotonic(), {"family": family, "phase": "start",
                                                                     "notes": [], "cases": {}}]  # fmt: skip
        for connection in wait(list(running), timeout=0.5):
            try:
                message = connection.recv()
            except (EOFError, OSError):  # the worker died
                process = running[connection][1]
                process.join(5)
                code = process.exitcode
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                finish(connection, _with_ending(running[connection][3], f"the worker crashed ({how})"))
                continue
            running[connection][3] = message
            if message.get("phase") == "done":
                finish(connection, message)
        for connection, (_, process, started, latest) in list(running.items()):
            if time.monotonic() - started > timeout:
                process.kill()
                finish(connection, _with_ending(latest, f"timed out after {timeout:g} s"))
    return [results[family] for family in families]


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


def _cell(text: Any, width: int = 60) -> str:
    text = str(text).replace("|", "/").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def _case_cell(case: dict[str, Any] | None) -> str:
    if not case:
        return "-"
    if case.get("ok"):  # ≈: within the tolerance of tiling, not bitwise
        return f"ok `{case.get('plan')}`" + (" ≈" if case.get("max_grad_diff") else "")
    return ("n/a: " if case.get("ok") is None else "ERROR: ") + _cell(case.get("error"), 50)


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table: one row per family."""
    rows = ["| family | status | built | bitwise | roomy | halfway | minimum | cold | max grad diff | s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for result in results:
        built = result.get("built")
        built_cell = f"yes ({result.get('layers')} layers)" if built is True else _cell(f"no: {built}", 60)
        bitwise = result.get("bitwise")
        if bitwise is None:
            bitwise_cell = "-" if built is not True else _cell(f"baseline: {result.get('baseline', '-')}", 60)
        elif bitwise.get("ok"):
            checkpointing = result.get("checkpointing", "")
            bitwise_cell = (
                "equal"
                + ("" if bitwise.get("checkpointing") else " (no ckpt)")
                + (" (ckpt alone inexact)" if checkpointing.startswith("not bitwise") else "")
            )
        else:
            bitwise_cell = ("n/a: " if bitwise.get("ok") is None else "ERROR: ") + _cell(bitwise.get("error"), 50)
        diffs = [c["max_grad_diff"] for c in result.get("cases", {}).values() if c.get("max_grad_diff") is not None]
        diff_cell = f"{max(diffs):.1e}" if diffs else "-"
        cells = [result["family"], result["status"], built_cell, bitwise_cell]
        cells += [_case_cell(result.get("cases", {}).get(name)) for name in CASES]
        cells += [diff_cell, f"{result.get('wall_seconds', 0):.0f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary(results: list[dict[str, Any]], seconds: float) -> str:
    counts = {status: [r["family"] for r in results if r["status"] == status]
              for status in (PASS, FAIL, NO_CONFIG, TRANSFORMERS_FAILS)}  # fmt: skip
    lines = [f"{len(results)} families in {seconds / 60:.1f} min (transformers {transformers.__version__}, torch "
             f"{torch.__version__}): " + ", ".join(f"{len(v)} {k}" for k, v in counts.items())]  # fmt: skip
    for result in results:
        for failure in result["failures"]:
            lines.append(f"- {result['family']} FAIL {_cell(failure, 400)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------------


def all_families() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--families", help="comma-separated families (transformers' model types), default: all")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds per family (default 300; the slowest took 105 on 2 cores)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="families at once (default: the cores)")
    parser.add_argument("--out", type=Path, help="write the results, errors and tracebacks included, to this JSON file")
    parser.add_argument("--list", action="store_true", help="print the families and exit")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        parser.error("--jobs and --timeout must be positive")
    known = all_families()
    if args.families:
        args.families = [name.strip() for name in args.families.split(",") if name.strip()]
        unknown = [name for name in args.families if name not in known]
        if unknown:
            parser.error(f"not a causal-LM family of transformers {transformers.__version__}: {', '.join(unknown)}")
    else:
        args.families = known
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(args.families))
        return 0
    started = time.monotonic()
    done = []

    def progress(result: dict[str, Any]) -> None:
        done.append(result)
        why = f": {_cell(result['failures'][0], 200)}" if result["failures"] else ""
        print(f"[{len(done)}/{len(args.families)}] {result['family']}: {result['status']} "
              f"({result['wall_seconds']:.0f} s){why}", file=sys.stderr, flush=True)  # fmt: skip

    results = run_sweep(args.families, args.jobs, args.timeout, progress)
    seconds = time.monotonic() - started
    print(table(results))
    print()
    print(summary(results, seconds))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"transformers": transformers.__version__, "torch": torch.__version__,
                "hf_offload": str(Path(hf_offload.__file__).parent), "python": platform.python_version(),
                "seconds": round(seconds, 1), "jobs": args.jobs, "timeout": args.timeout,
                "sizes": {"hidden": HIDDEN, "layers": LAYERS, "vocab": VOCAB, "batch": BATCH, "seq": SEQ,
                          "long_seq": LONG_SEQ, "probe_tokens": PROBE_TOKENS, "steps": STEPS,
                          "cold_steps": COLD_STEPS}}  # fmt: skip
        args.out.write_text(json.dumps({"meta": meta, "families": results}, indent=1, default=str) + "\n")
    return 1 if any(result["status"] == FAIL for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
