"""The engine: the saved-tensor hooks that move activations to host memory and back.

`OffloadActivations` (`offload.py`) is the one class a user meets: a `saved_tensors_hooks` context over the engine's
concerns, a module each, whose docstrings hold the decisions about streams, events and lifetimes next to the code:
  * `offload.py`: `OffloadActivations`: the options, the step's phases, the statistics, the peak watch and the public
    API; a change to when a step, its forward or its backward begins goes here.
  * `streams.py`: the compute stream and a side stream each way, per device (`_Lane`, `_SideStream`): which stream a
    copy runs on, and what orders it.
  * `host_copies.py`: the host copies and their lifetimes, the forward window, the tail and the pinned pool: what
    leaves the GPU, and when its memory is free again.
  * `prefetch.py`: the backward: unpacks, reloads, the prefetch points and the rules learned from the steps: when a
    reload starts (a new prefetch rule goes here).
  * `regions.py`: what is not offloaded here: `NoOpManager`, `exempt`, `set_aside`, standing aside and rejoining.
  * `settings.py`: `EngineSettings`, what a memory plan sets in the engine in one call (`apply_settings`).
"""

from .offload import OffloadActivations
from .prefetch import default_prefetch_window_bytes
from .regions import NoOpManager, top_saved_tensors_pack_hook
from .settings import CopyWindows, EngineSettings
from .streams import _SideStream as _SideStream  # for the tests' stand-in streams

__all__ = [
    "CopyWindows",
    "EngineSettings",
    "NoOpManager",
    "OffloadActivations",
    "default_prefetch_window_bytes",
    "top_saved_tensors_pack_hook",
]
