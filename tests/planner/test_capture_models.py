"""Graph capture of the models the Foundation issue names: tree shape and exact outputs.

For every model: the division tree has the structure of its architecture, every traced op
belongs to exactly one unit (or is the join of one block), unit names are unique, and the
reference runner reproduces ``model(x)`` exactly at full batch and closely on sub-batches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from core.units import Capture

from planner.graph.capture import capture
from planner.graph.inspect import BatchInspector, PARTS
from core.runner import run_reference
from core.loaded import ModelSpec
from planner.models import load_model
from core.tree import Layer, Parallel, Series, iter_layers, iter_nodes, node_from_json, node_to_json


def blocks(c: Capture) -> list[Parallel]:
    return [n for n in iter_nodes(c.tree) if isinstance(n, Parallel)]


def top_blocks(c: Capture) -> list[Parallel]:
    return [n for n in c.tree.children if isinstance(n, Parallel)]


def check_googlenet(c: Capture) -> None:
    inception = top_blocks(c)
    assert [b.name for b in inception] == ["inception3a", "inception3b", "inception4a", "inception4b",
                                           "inception4c", "inception4d", "inception4e", "inception5a",
                                           "inception5b"]
    assert all(len(b.branches) == 4 and b.join == "cat" for b in inception)
    assert all(all(br.children for br in b.branches) for b in inception)


def check_resnet50(c: Capture) -> None:
    bottlenecks = top_blocks(c)
    assert len(bottlenecks) == 16 and all(b.join == "add" and len(b.branches) == 2 for b in bottlenecks)
    shortcut = Counter("identity" if not b.branches[1].children else "downsample" for b in bottlenecks)
    assert shortcut == {"identity": 12, "downsample": 4}
    assert all(len(b.branches[0].children) == 3 for b in bottlenecks)


def check_squeezenet(c: Capture) -> None:
    fire = blocks(c)
    assert len(fire) == 8 and all(len(b.branches) == 2 and b.join == "cat" for b in fire)


def check_mobilenet_v2(c: Capture) -> None:
    residual = top_blocks(c)
    assert len(residual) == 10 and all(b.join == "add" for b in residual)
    assert all(any(not br.children for br in b.branches) for b in residual)  # identity shortcut
    # The 7 inverted residuals without a shortcut stay in the main series.
    names = {n.name for n in iter_layers(c.tree)}
    assert "features.1.conv.0.0" in names and "features.2.conv.0.0" in names


def check_vgg16(c: Capture) -> None:
    assert not blocks(c)
    assert all(isinstance(n, Layer) and n.kind == "layer" for n in c.tree.children)
    convs = [n for n in c.tree.children if n.name.startswith("features.") and "Conv" in str(
        type(c.model.module.get_submodule(n.name)).__name__)]
    assert len(convs) == 13


def check_inception_v3(c: Capture) -> None:
    outer = top_blocks(c)
    assert len(outer) == 11 and all(b.join == "cat" for b in outer)
    nested = [b for b in blocks(c) if b not in outer]
    assert len(nested) == 4  # InceptionE: 3x3 and 3x3dbl split into 1x3 | 3x1, twice


def check_densenet121(c: Capture) -> None:
    opaque = [n for n in c.tree.children if isinstance(n, Layer) and n.kind == "opaque"]
    assert [n.name for n in opaque] == [f"features.denseblock{i}" for i in range(1, 5)]
    assert not blocks(c)


def check_efficientnet_b0(c: Capture) -> None:
    se = [b for b in blocks(c) if b.join == "mul"]
    assert len(se) == 16
    residual = [b for b in top_blocks(c) if b.join == "add"]
    assert len(residual) == 9
    nested = [b for b in residual if any(isinstance(ch, Parallel) and ch.join == "mul"
                                         for ch in b.branches[0].children)]
    assert len(nested) == 9  # squeeze-and-excitation nested inside the residual branch


def check_convnext_tiny(c: Capture) -> None:
    cn = top_blocks(c)
    assert len(cn) == 18 and all(b.join == "add" and any(not br.children for br in b.branches) for b in cn)


def check_regnet_y_400mf(c: Capture) -> None:
    assert Counter(b.join for b in blocks(c)) == {"add": 16, "mul": 16}


def check_shufflenet(c: Capture) -> None:
    units = top_blocks(c)
    assert len(units) == 16 and all(b.join == "cat" and len(b.branches) == 2 for b in units)


def check_r3d_18(c: Capture) -> None:
    basic = top_blocks(c)
    assert len(basic) == 8 and all(b.join == "add" for b in basic)


def check_c3d(c: Capture) -> None:
    assert not blocks(c)
    kinds = Counter(type(c.model.module.get_submodule(n.name)).__name__ for n in c.tree.children)
    assert kinds == {"Conv3d": 8, "MaxPool3d": 5, "Linear": 3}


CASES: dict[str, tuple[Callable[[Capture], None], tuple[int, ...] | None]] = {
    "googlenet": (check_googlenet, None),
    "resnet50": (check_resnet50, None),
    "squeezenet1_0": (check_squeezenet, None),
    "mobilenet_v2": (check_mobilenet_v2, None),
    "vgg16": (check_vgg16, (3, 64, 64)),
    "inception_v3": (check_inception_v3, None),
    "densenet121": (check_densenet121, None),
    "efficientnet_b0": (check_efficientnet_b0, None),
    "convnext_tiny": (check_convnext_tiny, None),
    "regnet_y_400mf": (check_regnet_y_400mf, None),
    "shufflenet_v2_x1_0": (check_shufflenet, None),
    "r3d_18": (check_r3d_18, (3, 8, 56, 56)),
    "c3d": (check_c3d, None),
}


# C3D runs at its fixed 16 frames of 112x112 (its first linear layer takes 8192 features), the
# costliest case here: `make test-full` runs it, `make test` has r3d_18's 3-D convolutions
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "c3d" else n
                                  for n in CASES])
def test_capture_tree_and_reference_runner(name: str) -> None:
    check, shape = CASES[name]
    torch.manual_seed(0)
    loaded = load_model(ModelSpec(name, input_shape=shape))
    cap = capture(loaded)
    check(cap)

    # Unit names are unique and every traced activation op has exactly one owner.
    names = [n.name for n in iter_nodes(cap.tree)]
    assert len(names) == len(set(names)), "node names must be unique"
    infos = BatchInspector(cap.graph).inspect(loaded.example(sum(PARTS)))
    ops = {n.name for n, info in infos.items() if info.activation and n.op != "placeholder"}
    owned = [op for layer in iter_layers(cap.tree) for op in layer.ops]
    owned += [n.name for n in cap.graph.graph.nodes if cap.ops.get(n.name) in cap.joins]
    assert Counter(owned) == Counter(ops)

    # In a series each child's out is the next one's in (the profile contract).
    for node in iter_nodes(cap.tree):
        if isinstance(node, Series):
            for a, b in zip(node.children, node.children[1:]):
                assert a.out_bytes == b.in_bytes, (a.name, b.name)
    assert node_from_json(node_to_json(cap.tree, measured=False)) == cap.tree

    x = loaded.example(2, seed=3)
    with torch.inference_mode():
        expected = loaded.module(x)
    assert torch.equal(run_reference(cap, x), expected), "units at full batch must be bit-exact"
    # Sub-batches may pick other kernels: close, relative to the size of the outputs.
    scale = float(expected.abs().max())
    torch.testing.assert_close(run_reference(cap, x, batch=1), expected, rtol=1e-3, atol=1e-5 * scale)
