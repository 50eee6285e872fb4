"""Synthetic profiles shaped like real networks, for benchmarks and tests (no torch needed).

Sizes follow the activation shapes of GoogLeNet, ResNet-50 and a plain deep chain at 224x224
float32; times follow a per-sample cost that falls with the batch size, with deterministic
jitter so that per-sample time is not monotone (as measured on CPUs). A seed fixes everything.
"""

from __future__ import annotations

import random
from typing import Any

from core.tree import Profile, profile_from_json

F32 = 4


def _layer(rng: random.Random, name: str, in_b: int, out_b: int, B: int, flops: float,
           ws_per_sample: int = 0) -> dict[str, Any]:
    """A layer whose total time is flops-proportional, cheaper per sample at larger batches."""
    base = 1e-9 * flops + 2e-5
    time, ws = [], []
    for b in range(1, B + 1):
        efficiency = 1.0 / (1.0 + 0.6 / b)          # kernels get better with the batch...
        jitter = 1.0 + 0.08 * (rng.random() - 0.5)  # ...but not monotonically
        time.append(round(base * b / efficiency * 0.6 * jitter + 1e-5, 9))
        ws.append(int(ws_per_sample * b + (rng.randrange(0, 4) << 16) * (b % 3 == 0)))
    return {"kind": "layer", "name": name, "in": in_b, "out": out_b, "time": time, "ws": ws}


def _act(c: int, h: int, w: int) -> int:
    return c * h * w * F32


def googlenet_like(batch_max: int = 32, seed: int = 0) -> Profile:
    """A GoogLeNet-shaped tree: a 5-layer stem, 9 inception blocks of 4 branches, a head."""
    rng = random.Random(seed)
    B = batch_max
    nodes: list[dict[str, Any]] = []
    a_in = _act(3, 224, 224)
    stem = [("conv1", _act(64, 112, 112), 118e6), ("pool1", _act(64, 56, 56), 1e6),
            ("conv2", _act(64, 56, 56), 13e6), ("conv3", _act(192, 56, 56), 347e6),
            ("pool2", _act(192, 28, 28), 1e6)]
    cur = a_in
    for name, out, fl in stem:
        nodes.append(_layer(rng, name, cur, out, B, fl, ws_per_sample=out // 4))
        cur = out
    # (channels in, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj, spatial)
    cfg = [("3a", 64, 96, 128, 16, 32, 32, 28), ("3b", 128, 128, 192, 32, 96, 64, 28),
           ("4a", 192, 96, 208, 16, 48, 64, 14), ("4b", 160, 112, 224, 24, 64, 64, 14),
           ("4c", 128, 128, 256, 24, 64, 64, 14), ("4d", 112, 144, 288, 32, 64, 64, 14),
           ("4e", 256, 160, 320, 32, 128, 128, 14), ("5a", 256, 160, 320, 32, 128, 128, 7),
           ("5b", 384, 192, 384, 48, 128, 128, 7)]
    for idx, (tag, c1, r3, c3, r5, c5, pp, hw) in enumerate(cfg):
        if idx in (2, 7):
            out = cur * 1 // 4
            nodes.append(_layer(rng, f"pool_{tag}", cur, out, B, 1e6))
            cur = out
        out = _act(c1 + c3 + c5 + pp, hw, hw)
        fl = hw * hw * 1e3

        def br(*layers):
            return {"kind": "series", "name": f"inc{tag}_b{len(branches)}",
                    "children": list(layers)}
        branches: list[dict[str, Any]] = []
        branches.append(br(_layer(rng, f"inc{tag}_1x1", cur, _act(c1, hw, hw), B, fl * c1)))
        branches.append(br(_layer(rng, f"inc{tag}_3x3r", cur, _act(r3, hw, hw), B, fl * r3),
                           _layer(rng, f"inc{tag}_3x3", _act(r3, hw, hw), _act(c3, hw, hw), B,
                                  fl * c3 * 9, ws_per_sample=_act(r3, hw, hw) * 9 // 8)))
        branches.append(br(_layer(rng, f"inc{tag}_5x5r", cur, _act(r5, hw, hw), B, fl * r5),
                           _layer(rng, f"inc{tag}_5x5", _act(r5, hw, hw), _act(c5, hw, hw), B,
                                  fl * c5 * 9, ws_per_sample=_act(r5, hw, hw) * 9 // 8)))
        branches.append(br(_layer(rng, f"inc{tag}_pool", cur, cur, B, 1e6),
                           _layer(rng, f"inc{tag}_proj", cur, _act(pp, hw, hw), B, fl * pp)))
        nodes.append(_block(f"inc{tag}", cur, out, "cat", branches, B, 2e-6))
        cur = out
    return _with_head(rng, nodes, cur, 1024, B, 2e6, "googlenet-like",
                      f"synthetic-googlenet-{B}-{seed}")


def resnet50_like(batch_max: int = 32, seed: int = 0) -> Profile:
    """A ResNet-50-shaped tree: a stem, 16 bottleneck blocks (add joins), a head."""
    rng = random.Random(seed)
    B = batch_max
    nodes: list[dict[str, Any]] = []
    cur = _act(3, 224, 224)
    nodes.append(_layer(rng, "conv1", cur, _act(64, 112, 112), B, 118e6, _act(64, 112, 112) // 4))
    cur = _act(64, 112, 112)
    nodes.append(_layer(rng, "maxpool", cur, _act(64, 56, 56), B, 1e6))
    cur = _act(64, 56, 56)
    stages = [(3, 64, 256, 56), (4, 128, 512, 28), (6, 256, 1024, 14), (3, 512, 2048, 7)]
    for s, (blocks, mid, outc, hw) in enumerate(stages):
        for k in range(blocks):
            tag = f"layer{s + 1}.{k}"
            hw_in = hw * 2 if (k == 0 and s > 0) else hw
            out = _act(outc, hw, hw)
            fl = hw * hw * 1e3
            main = {"kind": "series", "name": f"{tag}.main", "children": [
                _layer(rng, f"{tag}.conv1", cur, _act(mid, hw_in, hw_in), B, fl * mid),
                _layer(rng, f"{tag}.conv2", _act(mid, hw_in, hw_in), _act(mid, hw, hw), B,
                       fl * mid * 9, _act(mid, hw, hw) * 9 // 8),
                _layer(rng, f"{tag}.conv3", _act(mid, hw, hw), out, B, fl * outc)]}
            if k == 0:
                short = {"kind": "series", "name": f"{tag}.down", "children": [
                    _layer(rng, f"{tag}.downsample", cur, out, B, fl * outc)]}
            else:
                short = {"kind": "series", "name": f"{tag}.identity", "children": []}
            nodes.append(_block(tag, cur, out, "add", [main, short], B, 1e-6))
            cur = out
    return _with_head(rng, nodes, cur, 2048, B, 4e6, "resnet50-like",
                      f"synthetic-resnet50-{B}-{seed}")


def _block(name: str, cur: int, out: int, join: str, branches: list[dict[str, Any]], B: int,
           fold_s: float) -> dict[str, Any]:
    """A parallel block whose folds take ``fold_s`` seconds per sample."""
    return {"kind": "parallel", "name": name, "in": cur, "out": out, "join": join,
            "branches": branches, "time": [round(fold_s * b, 9) for b in range(1, B + 1)]}


def _with_head(rng: random.Random, nodes: list[dict[str, Any]], cur: int, channels: int, B: int,
               fc_flops: float, model: str, fingerprint: str) -> Profile:
    """The nodes with a global pool and a 1000-class classifier after them, as a profile."""
    nodes.append(_layer(rng, "avgpool", cur, _act(channels, 1, 1), B, 1e6))
    nodes.append(_layer(rng, "fc", _act(channels, 1, 1), _act(1000, 1, 1), B, fc_flops))
    return profile_from_json({"batch_max": B, "meta": {"model": model, "fingerprint": fingerprint},
                              "root": nodes})


def chain_like(n_units: int = 150, batch_max: int = 32, seed: int = 0) -> Profile:
    """A plain chain of ``n_units`` layers whose activations shrink and grow like a deep CNN."""
    rng = random.Random(seed)
    B = batch_max
    sizes = [_act(3, 224, 224)]
    for i in range(n_units):
        hw = 112 >> min(4, (5 * i) // n_units)
        c = rng.choice([32, 64, 96, 128, 192, 256]) * (1 + (5 * i) // n_units)
        sizes.append(_act(c, hw, hw))
    nodes = [_layer(rng, f"layer{i}", sizes[i], sizes[i + 1], B, sizes[i + 1] * 50.0,
                    ws_per_sample=sizes[i] // rng.choice([2, 4, 8, 1 << 30]))
             for i in range(n_units)]
    return profile_from_json({"batch_max": B, "meta": {"model": f"chain-{n_units}", "fingerprint":
                              f"synthetic-chain-{n_units}-{B}-{seed}"}, "root": nodes})


def with_runtime(profile: Profile, seed: int = 0, *, runtime: str = "onnxruntime",
                 choice: str = "auto") -> Profile:
    """``profile`` as if a runtime that runs units in calls had measured it too: every unit
    faster inside a run than on torch (more so at small batches, where a fused graph or one
    launch saves the most), with a workspace of its own, a few units it cannot take (ONNX
    Runtime: graphs take every unit), and a
    call that costs a fixed part and a part by the bytes in and out (the shape
    ``planner.profiling.ort`` fits). ``runtime="cudagraph"``: units much faster at small
    batches (no launches), a small fixed cost, copies by the byte, and the host's issue of a
    replay (``host_s``: a call costs at least that), as ``planner.profiling.cudagraph``
    measures them."""
    import dataclasses

    from core.tree import Layer, Measured, Parallel, Series, iter_layers

    rng = random.Random(seed)
    B = profile.batch_max
    graphs = runtime == "cudagraph"

    def unit(node: Layer) -> Layer:
        torch = Measured(node.time, node.ws)
        if not graphs and rng.random() < 0.08:  # graphs capture every unit of such models
            return dataclasses.replace(node, runtimes=(("torch", torch),), runtime=("torch",) * B,
                                       unsupported=((runtime, "not exported"),))
        share = (lambda b: 0.2 + 0.7 * b / B) if graphs else (lambda b: 0.45 + 0.3 * b / B)
        inside = Measured(tuple(round(t * share(b) * (1 + 0.1 * rng.random()), 9)
                                for b, t in enumerate(node.time, start=1)),
                          tuple(w + node.out_bytes * b // 8 for b, w in enumerate(node.ws, start=1)))
        chosen = tuple(runtime if inside.time[b] < torch.time[b] else "torch" for b in range(B))
        pick = {runtime: inside, "torch": torch}
        return dataclasses.replace(
            node, time=tuple(pick[c].time[b] for b, c in enumerate(chosen)),
            ws=tuple(pick[c].ws[b] for b, c in enumerate(chosen)),
            runtimes=(("torch", torch), (runtime, inside)), runtime=chosen)

    def visit(node):  # type: ignore[no-untyped-def]
        if isinstance(node, Layer):
            return unit(node)
        if isinstance(node, Series):
            return dataclasses.replace(node, children=tuple(visit(c) for c in node.children))
        assert isinstance(node, Parallel)
        block = dataclasses.replace(node, branches=tuple(visit(b) for b in node.branches))
        inner = [u for b in block.branches for u in iter_layers(b)]
        takes = all(dict(u.runtimes).get(runtime) for u in inner)
        return dataclasses.replace(block, runtimes=((runtime, Measured(tuple(
            round(t * 0.5, 9) for t in block.time))),) if takes else ())

    meta = dict(profile.meta)
    meta["runtime"] = choice
    fixed, per_byte = (5e-6, 7e-13) if graphs else (8e-5, 6e-11)
    info = {"version": "synthetic",
            "call_s": [round(fixed * (1 + 0.2 * rng.random()), 9) for _ in range(B)],
            "byte_s": [round(per_byte * (1 + 0.2 * rng.random()), 15) for _ in range(B)]}
    if graphs:
        info["host_s"] = [round(2.5e-5 * (1 + 0.2 * rng.random()), 9) for _ in range(B)]
    meta["runtimes"] = {runtime: info}
    meta["fingerprint"] = f"{profile.fingerprint}-{runtime}-{seed}-{choice}"
    return Profile(batch_max=B, root=visit(profile.root), meta=meta)
