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

    Under DeepSpeed ZeRO-3 every module's parameters are all-gathered in DeepSpeed's forward pre-hook into
    `param.data` (and freed after, `param.data` then being an empty tensor; the full size is `param.ds_numel`).
    The audit's pre-hook runs after DeepSpeed's, so it sees them gathered: it counts them (`zero3_gathered_seen`)
    and their storages are live parameter storages for the check.

The memory budget (`--memory-budget`, with `--offload`): hf-offload profiles the first two steps and plans per
decoder layer; rank 0's plan, made for the longest of the ranks' steps, is broadcast. Each rank records, per
optimizer step, the plan code in force (`plans`, None in the profiled steps), the tokens it trained on
(`step_tokens`), the memory allocated as the step began and the device's peak over the step (`peaks`: the peak
counter is reset as each step begins, and every reset made during the step, by the planner while it profiles, is
seen first, so the value is the whole step's peak), and the budget in bytes (`budget_bytes`). Tiling stays off
(`tile_mlp=False`, `tile_layer=False`), so every plan is bitwise comparable with no offloading. `check_budget.py`
reads these. `--varied-lengths` gives the ranks padding-free packed batches (`DataCollatorWithFlattening`) of
different lengths in each step, sometimes longer on rank 0, sometimes on rank 1, and the profiled first step is not
the longest (`VARIED_EIGHTHS`).

`--cp-size N` trains under accelerate's context parallelism (FSDP2, sdpa run as torch's ring attention): each rank
trains on its shard of every sequence (README.md, "Context parallelism").

`--device-type cpu` runs the engine in its CPU test mode (for `accelerate launch --cpu`, gloo), so that the
bookkeeping, the audit and the comparison can be checked without a GPU (no peaks there: the host has no counter).
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
# examples/gloo_exit.py; named explicitly, as run_multi_gpu.sh runs with PYTHONSAFEPATH=1 (no script folder on the
# path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from gloo_exit import exit_process  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload import OffloadActivations, TrainingArguments  # noqa: E402
from hf_offload.memory_budget.spec import parse_memory_budget  # noqa: E402

VOCAB, HEADS, KV_HEADS = 1000, 8, 4
# --varied-lengths: per step (cycling), each rank's tokens per sample in eighths of --seq-len, (rank 0, rank 1).
# Step 0, profiled, is not the longest on either rank; in step 2, as the first plan is made, rank 0 trains on the most
# tokens (rank 1 on fewer than rank 0's step 0), and the ranks agree on that longest step first, so both run a plan made
# for it; step 3 is the longest on rank 1 (as long as step 2 on rank 0). Each batch is packed (padding-free):
# its second sample is an eighth of --seq-len shorter than its first, and the two are flattened into one row.
VARIED_EIGHTHS = ((6, 4), (4, 6), (8, 5), (3, 8))


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
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="activation_offloading_memory_budget (with --offload): bytes, '1.5GiB', '60%%'; tiling stays off",
    )
    parser.add_argument(
        "--tiling",
        action="store_true",
        help="with --memory-budget: the planner may tile (its default), so that a budget below every exact plan "
        "trains; losses then agree with the run without offloading within rounding, not bitwise",
    )
    parser.add_argument(
        "--varied-lengths",
        action="store_true",
        help="packed batches whose length differs between the ranks in each step (VARIED_EIGHTHS)",
    )
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (the MLP's is twice it)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample (--varied-lengths: the most)")
    parser.add_argument("--batch", type=int, default=2, help="samples per rank per step")
    parser.add_argument(
        "--cp-size",
        type=int,
        default=1,
        help="accelerate's context parallelism over this many ranks (ParallelismConfig(cp_size=...), FSDP2, sdpa "
        "attention run as torch's ring attention): each rank trains on its shard of every sequence; 1: none",
    )
    parser.add_argument(
        "--sp-size",
        type=int,
        default=1,
        help="DeepSpeed's Ulysses sequence parallelism over this many ranks (ParallelismConfig(sp_size=..., "
        "sp_backend='deepspeed'), ZeRO-1, sdpa attention between all-to-alls): each rank trains on its shard of "
        "every sequence; 1: none",
    )
    cli = parser.parse_args(argv)
    if cli.cp_size > 1 and cli.sp_size > 1:
        parser.error("--cp-size and --sp-size are two ways of sharding the sequence: give one")
    if cli.sp_size > 1 and cli.varied_lengths:
        parser.error("--sp-size shards sequences of one length; leave out --varied-lengths")
    if cli.cp_size > 1 and cli.varied_lengths:
        parser.error("--cp-size shards sequences of one length (a multiple of twice the cp size); leave out "
                     "--varied-lengths")  # fmt: skip
    if cli.memory_budget is not None and not cli.offload:
        parser.error("--memory-budget needs --offload (it is an option of hf-offload's)")
    if cli.tiling and cli.memory_budget is None:
        parser.error("--tiling is the memory budget's: it needs --memory-budget")
    return cli


def rank_file(out: str, rank: int) -> Path:
    path = Path(out)
    return path.with_name(f"{path.stem}.rank{rank}.json")


# ---------------------------------------------------------------------------------------------------- model and data


def build_model(lora: bool, hidden: int, layers: int, seq_len: int, attention: str = "eager") -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=seq_len,
        # Eager attention: plain matmuls and softmax, deterministic under torch.use_deterministic_algorithms; under
        # context parallelism sdpa, which torch's ring attention replaces.
        attn_implementation=attention,
    )
    model = transformers.LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
        model = get_peft_model(model, lora_config)
    return model


def _sequences(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Arithmetic token sequences (random start and stride mod the vocabulary): structured rather than noise."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (len(lengths), 1), generator=generator)
    strides = torch.randint(1, 8, (len(lengths), 1), generator=generator)
    tokens = (starts + strides * torch.arange(max(lengths))) % VOCAB
    return [row[:length] for row, length in zip(tokens, lengths)]


def synthetic_dataset(num_samples: int, seed: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """`num_samples` sequences of `seq_len` tokens, generated from their own seeded generator, identically on every
    rank; the distributed sampler splits them. With their positions, which Ulysses' sharding asks for."""
    positions = torch.arange(seq_len)
    return [{"input_ids": row, "labels": row.clone(), "position_ids": positions}
            for row in _sequences([seq_len] * num_samples, seed)]  # fmt: skip


def varied_lengths(steps: int, batch: int, world_size: int, seq_len: int) -> list[int]:
    """Each sample's length, in the order the sequential sampler hands them out: accelerate gives rank r the batches
    r, r + world_size, ..., so sample i is in step i // (batch * world_size), on rank (i // batch) % world_size."""
    lengths = []
    for index in range(steps * batch * world_size):
        step, rank = index // (batch * world_size), (index // batch) % world_size
        tokens = VARIED_EIGHTHS[step % len(VARIED_EIGHTHS)][rank % 2] * seq_len // 8
        lengths.append(tokens if index % batch == 0 else tokens - seq_len // 8)
    return lengths


def varied_dataset(steps: int, batch: int, world_size: int, seq_len: int, seed: int) -> list[dict[str, list[int]]]:
    """As `synthetic_dataset`, with the lengths of `varied_lengths` (lists: `DataCollatorWithFlattening` packs
    them)."""
    rows = _sequences(varied_lengths(steps, batch, world_size, seq_len), seed)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in rows]


# ---------------------------------------------------------------------------------------------------- instruments


class LossRecordingTrainer(transformers.Trainer):
    """Keeps the exact loss of every optimizer step on this rank (no averaging across ranks, no rounding), and the
    tokens it trained on; with `sequential=True` its sampler hands the samples out in order (`varied_lengths`)."""

    def __init__(self, *args, sequential: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses: list[float] = []
        self.step_tokens: list[int] = []
        self.sequential = sequential

    def _get_train_sampler(self, *args, **kwargs):
        if self.sequential:
            return torch.utils.data.SequentialSampler(self.train_dataset)
        return super()._get_train_sampler(*args, **kwargs)

    def training_step(self, model, inputs, *args, **kwargs):
        self.step_tokens.append(int(inputs["input_ids"].numel()))
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.step_losses.append(loss.detach().float().item())  # float32 -> Python float: exact
        return loss


def offloading_callback(trainer: transformers.Trainer) -> "hf_offload.ActivationOffloadingCallback | None":
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, hf_offload.ActivationOffloadingCallback):
            return callback
    return None


class StepMemory(transformers.TrainerCallback):
    """Per optimizer step on this rank: the memory plan in force, the memory allocated as the step began and the
    device's peak over the whole step (None for both in the CPU test mode).

    The peak counter is reset as each step begins. The memory budget's planner resets it too, inside the profiled
    steps (it measures phases of them): every reset is wrapped so that the counter's value just before it is kept,
    and the step's peak is the largest of those and the counter's value at the step's end (after the optimizer).
    """

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = trainer
        self.device = None
        self.plans: list[str | None] = []
        self.plan_tokens: list[int | None] = []
        self.peaks: list[int | None] = []
        self.allocated_at_begin: list[int | None] = []
        self._before_resets = 0
        self._original_reset = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.device.type == "cuda":
            self.device = torch.cuda
            self._original_reset = original = torch.cuda.reset_peak_memory_stats

            def reset_peak_memory_stats(device=None):
                self._before_resets = max(self._before_resets, torch.cuda.max_memory_allocated(device))
                return original(device)

            torch.cuda.reset_peak_memory_stats = reset_peak_memory_stats

    def on_train_end(self, args, state, control, **kwargs):
        if self._original_reset is not None:
            torch.cuda.reset_peak_memory_stats = self._original_reset
            self._original_reset = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.device is not None:
            self._original_reset()
            self._before_resets = 0
            self.allocated_at_begin.append(self.device.memory_allocated())
        else:
            self.allocated_at_begin.append(None)

    def on_step_end(self, args, state, control, **kwargs):
        self.peaks.append(None if self.device is None else max(self._before_resets, self.device.max_memory_allocated()))
        callback = offloading_callback(self.trainer)
        context = getattr(callback, "context", None) if callback is not None else None
        plan = getattr(context, "memory_plan", None)
        self.plans.append(None if plan is None else plan.code)
        self.plan_tokens.append(None if plan is None else plan.tokens)


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Data pointer of the storage behind a parameter (an FSDP2 DTensor's local shard); 0 if it has none now."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0
    # FSDP frees unsharded storage by resizing it to 0; ZeRO-3 replaces a released parameter's data by an empty tensor.
    return storage.data_ptr() if storage.nbytes() else 0


class ParameterAudit(transformers.TrainerCallback):
    """Records every tensor the engine judged eligible to offload that is in fact a parameter (see module doc)."""

    def __init__(self) -> None:
        self.model = None
        self.params: dict[int, torch.nn.Parameter] = {}  # every parameter object seen in a forward pre-hook
        self.handles = []
        self.eligible = 0
        self.violations: list[str] = []
        # ZeRO-3: parameters seen gathered in the pre-hook (every call counts), how many distinct ones, and how many
        # were seen still partitioned (DeepSpeed's pre-hook should have gathered them: the audit would then be blind).
        self.gathered_seen = 0
        self.gathered_ids: set[int] = set()
        self.partitioned_seen = 0

    def install(self) -> None:
        original = OffloadActivations._offload
        audit = self

        def _offload(engine, tensor):
            audit.check(tensor)
            return original(engine, tensor)

        OffloadActivations._offload = _offload

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # The Trainer has prepared the model by now (DDP, FSDP2's fully_shard, DeepSpeed's engine), so FSDP2's and
        # ZeRO-3's pre-forward hooks, which all-gather and install the unsharded parameters, run before ours.
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
            if hasattr(param, "ds_numel"):  # a ZeRO-3 parameter: gathered now, if DeepSpeed's pre-hook ran first
                if param.numel() == param.ds_numel and _storage_ptr(param):
                    self.gathered_seen += 1
                    self.gathered_ids.add(id(param))
                else:
                    self.partitioned_seen += 1

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
    """sha256 over this rank's trainable weights (name, then raw bytes), and how many elements they hold: its own
    shard under FSDP2 (the DTensor's local tensor) and under ZeRO-3 (`ds_tensor`, the partition the optimizer
    updates), the same on every run with the same world size, so runs compare rank by rank without a gather."""
    digest, numel = hashlib.sha256(), 0
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if not param.requires_grad:
            continue
        local = getattr(param, "ds_tensor", None)
        if local is None:
            local = getattr(param, "_local_tensor", param)
        local = local.detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(local.view(-1).view(torch.uint8).numpy().tobytes())
        numel += local.numel()
    return digest.hexdigest(), numel


def offload_stats(trainer: transformers.Trainer) -> dict | None:
    """The statistics summed over training by the ActivationOffloadingCallback, if the trainer has one."""
    callback = offloading_callback(trainer)
    return (callback.stats or None) if callback is not None else None


def budget_bytes(memory_budget: str | None, device_type: str) -> int | None:
    """The budget in bytes on this rank's device (a share of the device needs one)."""
    if memory_budget is None:
        return None
    total = None
    if device_type == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return parse_memory_budget(memory_budget).resolve(total)


# ---------------------------------------------------------------------------------------------------- main


def run_record(trainer: transformers.Trainer, memory: StepMemory, memory_budget: str | None, device_type: str) -> dict:
    """The fields of a rank's record that every example writes: its losses and tokens per step, the budget, and the
    plans and peaks `memory` saw."""
    return {
        "losses_hex": [loss.hex() for loss in trainer.step_losses],
        "losses": trainer.step_losses,
        "step_tokens": trainer.step_tokens,
        "memory_budget": memory_budget,
        "budget_bytes": budget_bytes(memory_budget, device_type),
        "plans": memory.plans,
        "plan_tokens": memory.plan_tokens,
        "peaks": memory.peaks,
        "allocated_at_step_begin": memory.allocated_at_begin,
    }


def main(argv=None) -> int:
    cli = parse_args(argv)
    transformers.set_seed(cli.seed)
    sharded = cli.cp_size > 1 or cli.sp_size > 1
    model = build_model(cli.lora, cli.hidden, cli.layers, cli.seq_len, "sdpa" if sharded else "eager")

    # transformers renamed gradient_checkpointing to activation_checkpointing (the old name is a deprecated alias);
    # use whichever this version has.
    new_name = hasattr(TrainingArguments, "activation_checkpointing")
    ckpt = "activation_checkpointing" if new_name else "gradient_checkpointing"
    extra = {"activation_offloading_device_type": cli.device_type} if cli.device_type else {}
    if cli.device_type == "cpu":  # the CPU test mode trains on the CPU too (gloo), even under a GPU launcher
        extra["use_cpu"] = True
    if cli.memory_budget is not None:
        extra["activation_offloading_memory_budget"] = cli.memory_budget
    if cli.memory_budget is not None and not cli.tiling:
        # No tiling: the plan's other actions change no arithmetic, so the run stays bitwise comparable.
        extra.update(activation_offloading_tile_mlp=False, activation_offloading_tile_layer=False)
    if cli.cp_size > 1:
        from accelerate import ParallelismConfig

        extra.update(parallelism_config=ParallelismConfig(cp_size=cli.cp_size), fsdp="full_shard",
                     fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})  # fmt: skip
    if cli.sp_size > 1:
        from accelerate import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        ulysses = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
        extra.update(parallelism_config=ParallelismConfig(sp_size=cli.sp_size, sp_backend="deepspeed",
                                                          sp_handler=ulysses),
                     deepspeed={"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto",
                                "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                "gradient_clipping": "auto"})  # fmt: skip
    args = TrainingArguments(
        output_dir=str(Path(cli.out).with_suffix("")) + "_trainer",
        activation_offloading=cli.offload,
        **{ckpt: cli.checkpointing, f"{ckpt}_kwargs": {"use_reentrant": False}},
        **extra,
        max_steps=cli.steps,
        per_device_train_batch_size=cli.batch,
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
    if cli.varied_lengths:
        dataset = varied_dataset(cli.steps, cli.batch, world_size, cli.seq_len, cli.seed)
        collator = transformers.DataCollatorWithFlattening()  # one row per batch, position_ids restart per sample
    else:
        dataset, collator = synthetic_dataset(cli.steps * cli.batch * world_size, cli.seed, cli.seq_len), None
    trainer = LossRecordingTrainer(
        model=model, args=args, train_dataset=dataset, data_collator=collator, sequential=cli.varied_lengths
    )
    audit = ParameterAudit()
    audit.install()
    trainer.add_callback(audit)
    memory = StepMemory(trainer)
    trainer.add_callback(memory)
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
    if cli.offload and not (stats or {}).get("tensors_offloaded") and cli.memory_budget is None:
        problems.append("offloading was on but moved nothing: the comparison would be vacuous")
    if len(trainer.step_losses) != cli.steps:
        problems.append(f"recorded {len(trainer.step_losses)} losses for {cli.steps} steps")
    if zero_stage == 3 and (audit.partitioned_seen or not audit.gathered_seen):
        problems.append(f"ZeRO-3: the audit saw {audit.gathered_seen} parameters gathered and "
                        f"{audit.partitioned_seen} still partitioned in its pre-hooks")  # fmt: skip

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
        "model": {"hidden": cli.hidden, "layers": cli.layers, "seq_len": cli.seq_len, "batch": cli.batch},
        "cp_size": cli.cp_size,
        "sp_size": cli.sp_size,
        "varied_lengths": cli.varied_lengths,
        "tiling": cli.tiling,
        "optimizer": optimizer,
        "zero_stage": zero_stage,
        **run_record(trainer, memory, cli.memory_budget, args.device.type),
        "weights_sha256": sha,
        "trainable_numel_local": numel,
        "offload_stats": stats,
        "param_audit": {
            "eligible_checked": audit.eligible,
            "violations": len(audit.violations),
            "examples": audit.violations[:5],
            "zero3_gathered_seen": audit.gathered_seen,
            "zero3_gathered_distinct": len(audit.gathered_ids),
            "zero3_partitioned_seen": audit.partitioned_seen,
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
    gathered = f", ZeRO-3 gathered parameters seen {audit.gathered_seen}" if zero_stage == 3 else ""
    peaks = [peak for peak in memory.peaks if peak is not None]
    budget = (f" | budget {record['budget_bytes']} plan {memory.plans[-1] if memory.plans else None}"
              f"{f' max peak {max(peaks)}' if peaks else ''}") if cli.memory_budget else ""  # fmt: skip
    print(f"[{mode} rank {rank}/{world_size}] offload={'on' if cli.offload else 'off'} lora={cli.lora} "
          f"ckpt={cli.checkpointing} optimizer={optimizer}{'' if zero_stage is None else f' zero={zero_stage}'} "
          f"steps={len(trainer.step_losses)} loss {losses[0]:.4f} -> {losses[-1]:.4f} | "
          f"offloaded {moved} tensors, kept as parameter {kept_param}, audited {audit.eligible} eligible, "
          f"parameter violations {len(audit.violations)}{gathered} | weights {sha[:12]}{budget} | "
          f"{'OK' if not problems else 'FAIL: ' + '; '.join(problems)} -> {path}", flush=True)  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    exit_process(main())  # destroys the process group, but a gloo one's rank leaves at once: gloo_exit.py says why
