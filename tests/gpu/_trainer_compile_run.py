"""One Trainer run of tests/gpu/test_gpu_compile.py, alone in its process, as a user's script runs one Trainer.

Runs in a process of its own because one process that trains several Trainers one after the other does not measure
each one's peak as its own script would: in such a sequence the same runs measured 1.151 and 1.064 GiB above the
parameters (layers compiled, whole model compiled), and 1.088 and 1.132 GiB each in its own process.

    python tests/gpu/_trainer_compile_run.py OUTPUT_DIR {regional,offloaded,whole} [--deterministic]

writes OUTPUT_DIR/result.pt: the losses, the weights, the peak above the parameters (and by phase, from the fifth
step on), Dynamo's graph and graph break counts, the offloading statistics and whether the Trainer compiled the model
as a whole. With --deterministic, torch's deterministic algorithms are on (as tests/gpu/conftest.py sets them around
the tests themselves), which runs compared bitwise need; without, the run is as a user's script runs it, whose peak is
the one a user sees.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # compile_runs, from tests/

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import transformers  # noqa: E402
from compile_runs import build  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import hf_offload  # noqa: E402

SHAPE = {"hidden": 1024, "layers": 8, "vocab": 1024}
VARIANTS = {  # name: (the Trainer's torch_compile, activation_offloading, layers and loss compiled by hand)
    "regional": (False, False, True),  # what torch_compile=True becomes under offloading, without offloading
    "offloaded": (True, True, False),
    "whole": (True, False, False),  # the Trainer's own torch_compile=True
}


class PhasePeaks(transformers.TrainerCallback):
    """The device's peak in each phase of the steps from the fifth on (after the steps whose peak hf-offload measures
    itself, by phases: its second, or up to its fourth), above the memory resident before training: the forward and
    backward, the optimizer step, and the rest of the step; and the run's peak, which those readings' resets would
    otherwise hide."""

    _FIRST_STEP = 5

    def __init__(self, resident: int) -> None:
        self.resident = resident
        self.highest = 0
        self.peaks = {"forward and backward": 0, "optimizer step": 0, "rest of the step": 0}

    def _read(self, state: transformers.TrainerState, phase: str) -> None:
        """Ends `phase` of the step under way (`global_step` counts the steps done before it)."""
        if state.global_step + 1 < self._FIRST_STEP:
            return
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - self.resident
        self.highest = max(self.highest, peak)
        if phase != "before":
            self.peaks[phase] = max(self.peaks[phase], peak)
        torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._read(state, "before" if state.global_step + 1 == self._FIRST_STEP else "rest of the step")

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self._read(state, "forward and backward")

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        self._read(state, "optimizer step")

    def run_peak(self) -> int:
        """The run's peak above the resident memory, the last step's rest included."""
        torch.cuda.synchronize()
        rest = torch.cuda.max_memory_allocated() - self.resident
        self.peaks["rest of the step"] = max(self.peaks["rest of the step"], rest)
        return max(self.highest, rest)


def train(output_dir: pathlib.Path, variant: str) -> dict:
    """8 AdamW steps of the Trainer (checkpointing on, bf16) on `build(...)`."""
    torch_compile, offloading, compile_by_hand = VARIANTS[variant]
    model = build(checkpointing=False, device="cuda", **SHAPE)
    if compile_by_hand:
        hf_offload.compile_decoder_layers(model)
        hf_offload.compile_loss(model)
    tokens = torch.randint(0, SHAPE["vocab"], (32, 1024), generator=torch.Generator().manual_seed(2))
    features = [{"input_ids": row.tolist(), "labels": row.tolist()} for row in tokens]
    args = hf_offload.TrainingArguments(
        str(output_dir / "trainer"), torch_compile=torch_compile, activation_offloading=offloading, max_steps=8,
        per_device_train_batch_size=4, learning_rate=1e-4, gradient_checkpointing=True, bf16=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=features,
                                   data_collator=transformers.default_data_collator)  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    phase_peaks = PhasePeaks(torch.cuda.memory_allocated())
    trainer.add_callback(phase_peaks)
    trainer.train()
    peak = phase_peaks.run_peak()
    offloading_callback = trainer.callback_handler.callbacks[0]
    return {
        "losses": [record["loss"] for record in trainer.state.log_history if "loss" in record],
        "weights": [p.detach().cpu().clone() for p in trainer.model.parameters()],
        "peak_gib": peak / 2**30,
        "graphs": (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())),
        "stats": dict(getattr(offloading_callback, "stats", {})),
        "whole": isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule),
        "phase_peaks_gib": {phase: round(nbytes / 2**30, 3) for phase, nbytes in phase_peaks.peaks.items()},
    }


if __name__ == "__main__":
    torch.use_deterministic_algorithms("--deterministic" in sys.argv[3:])
    output_dir = pathlib.Path(sys.argv[1])
    torch.save(train(output_dir, sys.argv[2]), output_dir / "result.pt")
