"""benchmarks/compile_native_offload.py (PyTorch's compile-time offloading pass, for a model compiled whole) on CPU: its
joint-graph pass marks the layers it names and no others, and the script runs end to end in its --tiny mode with the
pass on, so that the GPU measurement does not rot between GPU runs (a transformers release that renames the module stack
the pass reads would mark nothing, and the benchmark would then measure no offloading at all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "compile_native_offload.py"
sys.path.insert(0, str(REPO / "benchmarks"))
from compile_native_offload import MarkLayerActivations  # noqa: E402


def _graph_with_layers(stacks: list[dict]) -> torch.fx.GraphModule:
    """A graph of one `call_function` node per module stack, each with a tensor value."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    nodes = []
    for stack in stacks:
        value = graph.call_function(torch.neg, (value,))
        value.meta["val"] = torch.empty(2)
        value.meta["nn_module_stack"] = stack
        nodes.append(value)
    graph.output(value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_pass_marks_every_layer_but_the_last_and_nothing_outside_the_layers():
    stacks = [
        {"embed": ("L['self'].model.embed_tokens", object)},
        {"layer": ("L['self'].model.layers[0]", object), "mlp": ("L['self'].model.layers[0].mlp", object)},
        {"layer": ("model.layers.1.self_attn", object)},
        {"layer": ("L['self'].model.layers[2]", object)},
        {"head": ("L['self'].lm_head", object)},
    ]
    mark = MarkLayerActivations(layers=3)
    graph_module = mark(_graph_with_layers(stacks), joint_inputs=None)
    marked = [bool(node.meta.get("should_offload")) for node in graph_module.graph.nodes if node.op == "call_function"]
    assert marked == [False, True, True, False, False]
    assert mark.marked == 2


def test_the_tiny_run_offloads_through_the_pass_and_stays_bitwise_on_the_cpu(tmp_path):
    # On the CPU the pass's device_put to the CPU moves nothing, so the compiled graph computes what the baseline does.
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--variants", "compiled,compiled+native-sync",
                    "--out", str(tmp_path)], check=True, timeout=600, cwd=REPO)  # fmt: skip
    results = json.loads((tmp_path / "compile-native-offload.json").read_text())
    native = results["variants"]["compiled+native-sync"]
    assert "error" not in native, native.get("trace_tail")
    assert native["marked_nodes"] > 0  # layer 0 of the tiny model's two
    assert native["bitwise_vs"] == {"baseline": "compiled", "loss": True, "grads": True}
    assert results["variants"]["compiled"]["marked_nodes"] == 0
