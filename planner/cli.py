"""The planner's subcommands of ``vbs`` (``graph``, ``profile``) and what every subcommand
shares: the model flags, settings from flags, and ``run`` (errors as one line, exit code 2).

The ``vbs`` command itself is ``service.commands``, at the top of the import graph, where it
can import every subcommand module directly. Subcommands import torch only when they need
it, so ``vbs solve`` starts fast. ``--debug`` shows a traceback instead of the one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from core.errors import UsageError, VbsError
from core.runtimes import CHOICES
from planner.settings import Settings

log = logging.getLogger("vbs")


def positive_int(text: str) -> int:
    """An argparse ``type`` for a whole number >= 1 (a batch size, a count): the value, or an
    error argparse shows as a usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that say which model to load and how (shared by every model command)."""
    p.add_argument("--model", required=True,
                   help="torchvision model name (resnet50, r3d_18, ...), 'c3d', or 'pkg.module:factory'")
    p.add_argument("--input-shape", help="per-sample input shape, C,H,W or C,T,H,W (default: the model's)")
    p.add_argument("--weights", type=Path, help="a state_dict file, loaded with weights_only=True")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: VBS_DTYPE or float32")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: VBS_DEVICE or cpu")
    p.add_argument("--cache-dir", help="where profiles are cached (default: VBS_CACHE_DIR)")


def add_runtime_arg(p: argparse.ArgumentParser) -> None:
    """``--runtime``: which unit runtimes a profile measures and plans use."""
    p.add_argument("--runtime", choices=list(CHOICES),
                   help="unit runtimes: auto (every installed one that runs on the device, "
                        "the fastest per step), onnxruntime (CPU) or cudagraph (CUDA) "
                        "wherever it takes the unit, or torch (default: VBS_RUNTIME, auto)")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--precision``, ``--calibration``, ``--max-error``: int8 units (``planner.precision``)."""
    p.add_argument("--precision", choices=["float32", "int8", "bfloat16", "float16", "auto"],
                   help="the units at float32, int8 on ONNX Runtime (quantized from "
                        "--calibration, the error guard keeping float32 the units that move "
                        "the answer most), bfloat16 or float16 (the whole model on torch, "
                        "guarded) or auto (given samples, whichever measured fastest here, "
                        "else float32); serving, left unset or auto, each name is served at "
                        "what vbs plan planned it at (default: VBS_PRECISION)")
    p.add_argument("--calibration", type=Path, metavar="DIR",
                   help="samples of the model's input (.npy, or images) int8 is calibrated "
                        "and guarded on (default: VBS_CALIBRATION)")
    p.add_argument("--max-error", type=float, metavar="F",
                   help="the guard: the largest share of held-out samples whose top-1 may "
                        "differ from float32's (default: VBS_MAX_ERROR, 0.01)")


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags that were given override (as JSON values)."""
    overrides: dict[str, Any] = {}
    for field in ("dtype", "device", "store", "batch_max", "cache_dir", "runtime",
                  "select_rounds", "select_margin", "precision", "calibration", "max_error"):
        value = getattr(args, field, None)
        if value is not None:
            overrides[field] = str(value) if isinstance(value, Path) else value
    return overrides


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by the flags that were given."""
    try:
        return Settings(**given_settings(args))
    except ValueError as exc:
        raise UsageError(f"invalid setting: {exc}") from exc


def load_capture(args: argparse.Namespace, settings: Settings) -> Any:
    """Load and capture the model the flags name (imports torch)."""
    from planner.graph.capture import capture
    from core.spec import ModelSpec
    from core.shapes import parse_shape
    from planner.models import apply_threads, load_model

    apply_threads(settings.threads)
    shape = parse_shape(args.input_shape) if args.input_shape else None
    spec = ModelSpec(name=args.model, input_shape=shape, dtype=settings.dtype,
                     device=settings.device, weights=Path(args.weights) if args.weights else None)
    cap = capture(load_model(spec))
    if settings.precision == "float32":
        return cap
    from planner.precision import with_precision  # ONNX Runtime's quantizer

    return with_precision(cap, settings.precision, settings.calibration, settings.max_error,
                          settings.profile_cache)


def cmd_graph(args: argparse.Namespace) -> int:
    from core.tree import node_to_json, render

    cap = load_capture(args, settings_from(args))
    if args.json:
        print(json.dumps(node_to_json(cap.tree, measured=False), indent=1))
    else:
        print("\n".join(render(cap.tree)))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from planner.profiling.profiler import ProfileOptions, cached_profile, measure
    from core.tree import save_profile

    settings = settings_from(args)
    options = ProfileOptions(batch_max=args.batch_max, repeats=args.repeats or settings.profile_repeats,
                             warmup=settings.profile_warmup, grid=args.grid or settings.profile_grid,
                             runtime=settings.runtime)
    cap = load_capture(args, settings)
    if args.no_cache:
        profile, hit = measure(cap, options, progress=not args.quiet), False
    else:
        profile, hit = cached_profile(cap, options, settings.profile_cache, progress=not args.quiet)
    if args.out:
        save_profile(profile, args.out)
    m = profile.meta
    how = "cache hit" if hit else f"measured in {m.get('elapsed_s')} s"
    print(f"{m.get('model')}: {m.get('units')} units, {m.get('parallel_blocks')} parallel blocks, "
          f"b = 1..{profile.batch_max} on {m.get('device_name')} ({how}); fingerprint {profile.fingerprint}"
          + (f"; written to {args.out}" if args.out else ""))
    for line in runtime_lines(profile):
        print(line)
    return 0


def runtime_lines(profile: Any) -> list[str]:
    """What a profile says of its unit runtimes: how many units each is the fastest for, and
    which units a runtime cannot take, and why."""
    from collections import Counter

    from core.tree import iter_layers, iter_nodes

    from core.precision import Precision

    meta = profile.meta.get("runtimes") or {}
    lines = [f"  {name}: unavailable here: {info['unavailable']}"
             for name, info in meta.items() if info.get("unavailable")]
    precision = Precision.from_json(profile.meta.get("precision"))
    if precision.int8:
        lines.append(f"  precision: {len(precision.int8)} units int8 on ONNX Runtime (the rest "
                     f"float32): top-1 agreement {100 * precision.agreement:.1f}% with float32 "
                     f"on {precision.held_out} held-out samples, largest difference "
                     f"{precision.error:.3g} of the output's scale"
                     + (f", {precision.speedup:.2f}x float32's speed" if precision.speedup else "")
                     + f" ({precision.why})")
    elif precision.half:
        lines.append(f"  precision: {precision.dtype}, every unit on torch: top-1 agreement "
                     f"{100 * precision.agreement:.1f}% with float32 on {precision.held_out} "
                     f"held-out samples, largest difference {precision.error:.3g} of the "
                     "output's scale"
                     + (f", {precision.speedup:.2f}x float32's speed" if precision.speedup else "")
                     + f" ({precision.why})")
    fastest = Counter(rt for layer in iter_layers(profile.root) for rt in layer.runtime)
    if fastest:
        lines.append("  fastest (units x batch sizes): " + ", ".join(
            f"{name} {count}" for name, count in fastest.most_common()))
    for node in iter_nodes(profile.root):
        for name, why in getattr(node, "unsupported", ()):
            lines.append(f"  {node.name}: runs on torch, not {name}: {why}")
    return lines


def add_parser(sub: Any) -> None:
    """The planner's own subcommands: ``graph`` and ``profile``."""
    p = sub.add_parser("graph", help="print the division tree of a model")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="the tree as JSON (vbs.profile/1 nodes, no times)")
    p.set_defaults(func=cmd_graph)

    p = sub.add_parser("profile", help="measure time and memory of every unit at every batch size")
    add_model_args(p)
    p.add_argument("--batch-max", type=positive_int, required=True, help="largest batch size to measure")
    add_runtime_arg(p)
    add_precision_args(p)
    p.add_argument("--out", type=Path, help="write the profile JSON here (it is cached either way)")
    p.add_argument("--grid", action="store_true", help="measure a grid of batch sizes and interpolate")
    p.add_argument("--repeats", type=positive_int, help="timed runs per (unit, batch); default 5")
    p.add_argument("--no-cache", action="store_true", help="measure even if a cached profile exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_profile)


def run(args: argparse.Namespace) -> int:
    """Run the parsed subcommand: a VbsError becomes one line on stderr and exit code 2."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except VbsError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())  # one line, whatever a library put in it
        print(f"vbs {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
