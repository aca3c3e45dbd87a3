"""A 20-step Trainer fine-tune under DDP, FSDP2 or DeepSpeed, that records exactly what it did.

Launch it with one of the accelerate configs beside this file; run it twice, without and with `--offload`, and
compare the two runs with `compare.py`:

    accelerate launch --config_file examples/distributed/ddp.yaml examples/distributed/train_distributed.py \
        --no-offload --out runs/ddp_off.json
    accelerate launch --config_file examples/distributed/ddp.yaml examples/distributed/train_distributed.py \
        --offload --out runs/ddp_on.json
    python examples/distributed/compare.py runs/ddp_off.json runs/ddp_on.json

The model is a small Llama built from a config (random weights, fixed seed) and the data are synthetic token
sequences generated from a fixed seed; every rank builds the same dataset and the Trainer's distributed sampler
gives each rank its share. Offloading is switched on the way users do it: `hf_offload.TrainingArguments` with
`activation_offloading=True`.

Each rank writes `<out stem>.rank<R>.json`: the loss of every step as `float.hex` (exact), a hash of its final
trainable weights (its local shard under FSDP2), the hf-offload statistics, and a parameter audit:

    Parameters must never be offloaded. FSDP2 all-gathers a layer's unsharded parameters in its forward
    pre-hook, into storage that exists only while the layer runs, so the engine cannot know those storages in
    advance. The audit registers a forward pre-hook on every module *after* the distributed wrappers registered
    theirs (so it sees the unsharded parameters), and wraps `OffloadActivations._offload`, the method the engine
    calls for every tensor it judged eligible to move: a tensor whose storage is that of a live parameter, or
    that is a view of an `nn.Parameter`, is a violation. Any violation makes the script exit non-zero.

`--device-type cpu` runs the engine in its CPU test mode (for `accelerate launch --cpu`, gloo), so that the
bookkeeping, the audit and the comparison can be checked without a GPU.
"""

import argparse
import hashlib
import json
import os
import sys
from itertools import chain
from pathlib import Path

# cuBLAS reads this when it initialises; deterministic algorithms need it (full_determinism sets it too, later).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # no fragmentation at long context

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload import OffloadActivations, TrainingArguments  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, SEQ_LEN, BATCH = 1000, 256, 4, 8, 4, 256, 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="activation_offloading=True (hf-offload)",
    )
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (r=8) on the attention projections")
    parser.add_argument("--checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="losses.json", help="each rank writes <stem>.rank<R>.json next to it")
    parser.add_argument(
        "--device-type", default=None, help="activation_offloading_device_type; 'cpu' = the engine's CPU test mode"
    )
    return parser.parse_args(argv)


def rank_file(out: str, rank: int) -> Path:
    path = Path(out)
    return path.with_name(f"{path.stem}.rank{rank}.json")


# ---------------------------------------------------------------------------------------------------- model and data


def build_model(lora: bool) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ_LEN,
        # Eager attention: plain matmuls and softmax, deterministic under torch.use_deterministic_algorithms.
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
        model = get_peft_model(model, lora_config)
    return model


def synthetic_dataset(num_samples: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Arithmetic token sequences (random start and stride mod the vocabulary): structured rather than noise.

    Generated from its own seeded generator, identically on every rank; the distributed sampler splits it.
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (num_samples, 1), generator=generator)
    strides = torch.randint(1, 8, (num_samples, 1), generator=generator)
    tokens = (starts + strides * torch.arange(SEQ_LEN)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


# ---------------------------------------------------------------------------------------------------- instruments


class LossRecordingTrainer(transformers.Trainer):
    """Keeps the exact loss of every optimizer step on this rank (no averaging across ranks, no rounding)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses: list[float] = []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(loss.detach().float().item())  # float32 -> Python float: exact
        return loss


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Data pointer of the storage behind a parameter (an FSDP2 DTensor's local shard); 0 if it has none now."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0
    return storage.data_ptr() if storage.nbytes() else 0  # FSDP frees unsharded storage by resizing it to 0


class ParameterAudit(transformers.TrainerCallback):
    """Records every tensor the engine judged eligible to offload that is in fact a parameter (see module doc)."""

    def __init__(self) -> None:
        self.model = None
        self.params: dict[int, torch.nn.Parameter] = {}  # every parameter object seen in a forward pre-hook
        self.handles = []
        self.eligible = 0
        self.violations: list[str] = []

    def install(self) -> None:
        original = OffloadActivations._offload
        audit = self

        def _offload(engine, tensor):
            audit.check(tensor)
            return original(engine, tensor)

        OffloadActivations._offload = _offload

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # The Trainer has prepared the model by now (DDP, FSDP2's fully_shard, DeepSpeed's engine), so FSDP2's
        # pre-forward hooks, which all-gather and install the unsharded parameters, run before ours.
        self.model = model
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self._record))

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _record(self, module, args):
        for param in module.parameters(recurse=False):
            self.params[id(param)] = param

    def check(self, tensor: torch.Tensor) -> None:
        self.eligible += 1
        # Pointers of the storages that parameters hold *now*: a freed (resharded) storage has none, so a stale
        # address reused by an activation is never mistaken for a parameter.
        live = {_storage_ptr(p) for p in chain(self.params.values(), self.model.parameters())} - {0}
        if _storage_ptr(tensor) in live:
            self.violations.append(f"storage of a live parameter: {tuple(tensor.shape)} {tensor.dtype}")
        elif isinstance(tensor._base, torch.nn.Parameter):
            self.violations.append(f"view of an nn.Parameter: {tuple(tensor.shape)} {tensor.dtype}")


def weights_hash(model: torch.nn.Module) -> tuple[str, int]:
    """sha256 over this rank's trainable weights (name, then raw bytes), and how many elements they hold."""
    digest, numel = hashlib.sha256(), 0
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if not param.requires_grad:
            continue
        local = getattr(param, "_local_tensor", param).detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(local.view(-1).view(torch.uint8).numpy().tobytes())
        numel += local.numel()
    return digest.hexdigest(), numel


def offload_stats(trainer: transformers.Trainer) -> dict | None:
    """The statistics summed over training by the ActivationOffloadingCallback, if the trainer has one."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, hf_offload.ActivationOffloadingCallback):
            return callback.stats or None
    return None


# ---------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    cli = parse_args(argv)
    transformers.set_seed(cli.seed)
    model = build_model(cli.lora)

    # transformers renamed gradient_checkpointing to activation_checkpointing (the old name is a deprecated alias);
    # use whichever this version has.
    new_name = hasattr(TrainingArguments, "activation_checkpointing")
    ckpt = "activation_checkpointing" if new_name else "gradient_checkpointing"
    extra = {"activation_offloading_device_type": cli.device_type} if cli.device_type else {}
    if cli.device_type == "cpu":  # the CPU test mode trains on the CPU too (gloo), even under a GPU launcher
        extra["use_cpu"] = True
    args = TrainingArguments(
        output_dir=str(Path(cli.out).with_suffix("")) + "_trainer",
        activation_offloading=cli.offload,
        **{ckpt: cli.checkpointing, f"{ckpt}_kwargs": {"use_reentrant": False}},
        **extra,
        max_steps=cli.steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        optim="adamw_torch",
        seed=cli.seed,
        full_determinism=True,  # deterministic kernels: two runs differ only by what offloading changes
        logging_steps=1,  # the hf-offload callback logs (and so sums) its statistics every step
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    world_size = args.world_size
    trainer = LossRecordingTrainer(
        model=model, args=args, train_dataset=synthetic_dataset(cli.steps * BATCH * world_size, cli.seed)
    )
    audit = ParameterAudit()
    audit.install()
    trainer.add_callback(audit)
    trainer.train()

    accelerator = trainer.accelerator
    mode = str(accelerator.distributed_type).split(".")[-1]
    if mode == "FSDP":
        mode += f"{getattr(accelerator.state.fsdp_plugin, 'fsdp_version', 1)}"
    stats = offload_stats(trainer)
    # What actually trained: e.g. DeepSpeedZeroOptimizer around the Trainer's torch AdamW under DeepSpeed.
    optimizer = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    zero_stage = getattr(trainer.model_wrapped, "zero_optimization_stage", lambda: None)()
    sha, numel = weights_hash(trainer.model)
    problems = []
    if audit.violations:
        problems.append(f"{len(audit.violations)} parameter tensor(s) judged eligible for offloading")
    if cli.offload and not (stats or {}).get("tensors_offloaded"):
        problems.append("offloading was on but moved nothing: the comparison would be vacuous")
    if len(trainer.step_losses) != cli.steps:
        problems.append(f"recorded {len(trainer.step_losses)} losses for {cli.steps} steps")

    rank = args.process_index
    record = {
        "rank": rank,
        "world_size": world_size,
        "mode": mode,
        "offload": cli.offload,
        "lora": cli.lora,
        "checkpointing": cli.checkpointing,
        "device_type": cli.device_type,
        "steps": cli.steps,
        "optimizer": optimizer,
        "zero_stage": zero_stage,
        "losses_hex": [loss.hex() for loss in trainer.step_losses],
        "losses": trainer.step_losses,
        "weights_sha256": sha,
        "trainable_numel_local": numel,
        "offload_stats": stats,
        "param_audit": {
            "eligible_checked": audit.eligible,
            "violations": len(audit.violations),
            "examples": audit.violations[:5],
        },  # fmt: skip
        "versions": {
            name: __import__(name).__version__ for name in ("torch", "transformers", "accelerate", "hf_offload")
        },
        "problems": problems,
    }
    path = rank_file(cli.out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))

    losses = trainer.step_losses or [float("nan")]
    kept_param = (stats or {}).get("tensors_kept_parameter", 0)
    moved = (stats or {}).get("tensors_offloaded", 0)
    print(f"[{mode} rank {rank}/{world_size}] offload={'on' if cli.offload else 'off'} lora={cli.lora} "
          f"ckpt={cli.checkpointing} optimizer={optimizer}{'' if zero_stage is None else f' zero={zero_stage}'} "
          f"steps={len(trainer.step_losses)} loss {losses[0]:.4f} -> {losses[-1]:.4f} | "
          f"offloaded {moved} tensors, kept as parameter {kept_param}, audited {audit.eligible} eligible, "
          f"parameter violations {len(audit.violations)} | weights {sha[:12]} | "
          f"{'OK' if not problems else 'FAIL: ' + '; '.join(problems)} -> {path}", flush=True)  # fmt: skip
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
