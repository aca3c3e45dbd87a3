"""How the examples end when they run as ranks of a gloo process group (on the CPU under torchrun/accelerate launch).

A gloo worker thread releases the collective it ran after the rank that waited on it has moved on, and releasing
tensors whose Python objects are gone takes the GIL. If the script has ended by then (the Trainer's last collective,
the all_gather of the step FLOPs at the end of `train()`, is right before the end), the thread asks for the GIL while
the interpreter shuts down; Python ends the thread, and ending it inside the release's destructor aborts the rank
with "terminate called without an active exception" (exit -6) after its training finished
(pytorch/pytorch#190489, torch 2.13). `destroy_process_group()` does not prevent it: gloo's shutdown leaves the
threads running, and when the DDP model then goes, the group's destructor waits for them holding the GIL (a hang).
So a gloo rank leaves without the interpreter's shutdown, once its output is flushed.
"""

import logging
import os
import sys
from typing import NoReturn

import torch


def exit_process(code: int = 0) -> NoReturn:
    """Ends the process with `code`: at once as a rank of a gloo process group, otherwise with `sys.exit`, after
    destroying a process group of another backend (NCCL's frees its communicators, as torch asks)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and "gloo" in torch.distributed.get_backend():
        logging.shutdown()  # what the interpreter's shutdown would flush
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if distributed:
        torch.distributed.destroy_process_group()
    sys.exit(code)
