"""Where the memory of many ONNX Runtime sessions of one model's runs goes, and what shares it.

    python bench/ort_weights_probe.py [--dir /tmp/ort-weights-probe] [--rounds 15]
                                      [--options current,shared,...]

resnet18 (random weights) at 224 px is captured and exported unit by unit
(``export_units``), and every prefix and suffix of its root's children is composed into a
graph saved under ``--dir`` (39 runs: one process, the only one that imports torch; kept and
reused when already there). Then, for each option, a fresh process without torch makes the
39 sessions, runs each once at batch 1 and 8 as it makes it (what serving does), and reads
its resident set (VmRSS after ``malloc_trim``) before and after: "made" after the sessions
were made, "ran" after they ran (the difference is the arena's activations). A last process
times a few runs at batch 1 and 8 for the options, interleaved call by call, and prints the
median and the 10th-90th percentiles (ms per call).

Options (``session_options()`` of ``core.runtimes.onnxrt`` is "current"):
    current          own weights, ORT_ENABLE_ALL, the process's shared arena
    current_dropbytes the same, the serialized graph InferenceSession keeps (``_model_bytes``,
                     the weights' second copy) dropped once the session is made
    current_noarena  the same, enable_cpu_mem_arena False
    current_sessarena the same, an arena of each session's own
    own_disable      own weights, ORT_DISABLE_ALL
    own_extended     own weights, ORT_ENABLE_EXTENDED (no NCHWc layout)
    ext_disable      add_external_initializers, one OrtValue a weight name, ORT_DISABLE_ALL
    init_extended    add_initializer, one OrtValue a weight name, ORT_ENABLE_EXTENDED
    init_all         add_initializer, ORT_ENABLE_ALL
    init_all_noprepack  the same with session.disable_prepacking
    ortfmt           ORT format (converted at ENABLE_ALL), use_ort_model_bytes_directly
                     (use_ort_model_bytes_for_initializers too segfaults in Python)
    shared           core.runtimes.ort_weights.SharedWeights over "current"'s options
    shared_noprepack the same with session.disable_prepacking
    shared_noarena   the same with enable_cpu_mem_arena False
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_OPTIONS = ("current", "current_dropbytes", "current_noarena", "current_sessarena", "own_disable", "own_extended",
               "ext_disable", "init_extended", "init_all", "init_all_noprepack", "ortfmt",
               "shared", "shared_noprepack", "shared_noarena")
TIMED = ("current", "own_extended", "init_extended", "ortfmt", "shared", "shared_noprepack")
TIMED_RUNS = ("run03_0_3", "run19_0_19", "run34_15_19")  # conv1..layer1.0.relu, all, layer4.0.relu..fc
THREADS = 2


def export(folder: str) -> None:
    """The 39 composed graphs of resnet18 at 224 px (this process imports torch)."""
    import onnx
    import torch

    from core.loaded import ModelSpec
    from core.runtimes.onnx_graphs import export_units
    from planner.graph.capture import capture
    from planner.models import load_model

    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("resnet18", input_shape=(3, 224, 224))))
    graphs = export_units(cap)
    children = cap.tree.children
    n = len(children)
    runs = [(0, j) for j in range(n)] + [(i, n - 1) for i in range(1, n)]
    os.makedirs(folder, exist_ok=True)
    for k, (i, j) in enumerate(runs):
        onnx.save(graphs.compose(children[i:j + 1]), os.path.join(folder, f"run{k:02d}_{i}_{j}.onnx"))


def convert(folder: str) -> None:
    """Each graph in ORT format, optimised at ORT_ENABLE_ALL (this machine's layouts)."""
    import onnxruntime as ort

    for path in sorted(glob.glob(os.path.join(folder, "run*.onnx"))):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = path[:-5] + ".ort"
        options.add_session_config_entry("session.save_model_format", "ORT")
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


# --- in the measuring processes: no torch ------------------------------------------------

def _rss() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _environment() -> None:
    """What core.runtimes.onnxrt sets up once: one arena for every session."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                             ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))


def _options(level: str = "all", arena: str = "env", prepack: bool = True):
    """core.runtimes.onnxrt.session_options(THREADS) with the level, arena and prepacking
    changed (copied: that module imports torch)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[level]
    if arena == "env":
        options.add_session_config_entry("session.use_env_allocators", "1")
    elif arena == "none":
        options.enable_cpu_mem_arena = False
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


class _Maker:
    """Makes the sessions of one option (state shared between them: the weights)."""

    def __init__(self, option: str) -> None:
        import onnxruntime as ort

        from core.runtimes.ort_weights import SharedWeights

        self.option = option
        self.values: dict[str, object] = {}
        self.shared = SharedWeights() if option.startswith("shared") else None
        self.ort = ort

    def make(self, path: str):
        import onnx
        from onnx import numpy_helper

        ort, option = self.ort, self.option
        cpu = ["CPUExecutionProvider"]
        if option == "current":
            return ort.InferenceSession(_bytes(path), _options(), providers=cpu)
        if option == "current_dropbytes":  # the Python wrapper keeps the bytes it was given
            session = ort.InferenceSession(_bytes(path), _options(), providers=cpu)
            session._model_bytes = None
            return session
        if option == "current_noarena":
            return ort.InferenceSession(_bytes(path), _options(arena="none"), providers=cpu)
        if option == "current_sessarena":
            return ort.InferenceSession(_bytes(path), _options(arena="own"), providers=cpu)
        if option == "own_disable":
            return ort.InferenceSession(_bytes(path), _options("disable"), providers=cpu)
        if option == "own_extended":
            return ort.InferenceSession(_bytes(path), _options("extended"), providers=cpu)
        if option == "ortfmt":
            options = _options()
            options.add_session_config_entry("session.use_ort_model_bytes_directly", "1")
            # session.use_ort_model_bytes_for_initializers as well: ORT 1.32's Python binding
            # segfaults (at the first call, or making the session): the bytes it would keep
            # pointing into are a temporary copy
            return ort.InferenceSession(_bytes(path[:-5] + ".ort"), options, providers=cpu)
        if self.shared is not None:
            options = _options(arena="none" if option == "shared_noarena" else "env",
                               prepack=option != "shared_noprepack")
            return self.shared.session(onnx.load(path), options, cpu)
        # one OrtValue per weight name, every session's graph without the weights' bytes
        level = {"ext_disable": "disable", "init_extended": "extended"}.get(option, "all")
        options = _options(level, prepack=option != "init_all_noprepack")
        model = onnx.load(path)
        names = []
        for tensor in model.graph.initializer:
            if tensor.name not in self.values:
                array = numpy_helper.to_array(tensor).copy()
                self.values[tensor.name] = (array, ort.OrtValue.ortvalue_from_numpy(array))
            names.append(tensor.name)
        if option == "ext_disable":
            for tensor in model.graph.initializer:
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
                del tensor.external_data[:]
                for k, v in (("location", "x.bin"), ("offset", "0"), ("length", "0")):
                    e = tensor.external_data.add()
                    e.key, e.value = k, v
            options.add_external_initializers(names, [self.values[n][1] for n in names])
        else:
            for n in names:
                options.add_initializer(n, self.values[n][1])
        return ort.InferenceSession(model.SerializeToString(), options, providers=cpu)

    @property
    def weights(self) -> int:
        if self.shared is not None:
            return self.shared.held_bytes
        return sum(a.nbytes for a, _ in self.values.values())


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _input(session, batch: int):
    import numpy as np

    shape = session.get_inputs()[0].shape[1:]
    return np.random.default_rng(batch).random((batch, *shape), dtype=np.float32)


def rss(folder: str, option: str) -> None:
    """Make the 39 sessions of ``option``, each run at batch 1 and 8; print JSON."""
    import onnxruntime  # noqa: F401  (its import is not the sessions' growth)

    _environment()
    paths = sorted(glob.glob(os.path.join(folder, "run*.onnx")))
    base = _rss()
    maker = _Maker(option)
    sessions, made_growth, started = [], [], time.perf_counter()
    for path in paths:
        before = _rss()
        session = maker.make(path)
        made_growth.append(_rss() - before)
        for batch in (1, 8):
            session.run(None, {"x": _input(session, batch)})
        sessions.append(session)
    seconds = time.perf_counter() - started
    ran = _rss()
    assert "torch" not in sys.modules
    print(json.dumps({"option": option, "sessions": len(sessions), "ran": ran - base,
                      "weights": maker.weights, "seconds": seconds,
                      "made_after_first": statistics.median(made_growth[1:]),
                      "made": sum(made_growth)}))


def timing(folder: str, options: list[str], rounds: int) -> None:
    """Per-call time of a few runs at batch 1 and 8, options interleaved; print JSON."""
    import numpy as np

    _environment()
    sessions, makers = {}, []  # a maker holds the weights its sessions read (add_initializer
    for option in options:     # keeps no reference to them)
        maker = _Maker(option)
        makers.append(maker)
        for run in TIMED_RUNS:
            sessions[(option, run)] = maker.make(os.path.join(folder, run + ".onnx"))
    times: dict[str, list[float]] = {}
    for batch in (1, 8):
        for run in TIMED_RUNS:
            x = _input(sessions[(options[0], run)], batch)
            ref = sessions[(options[0], run)].run(None, {"x": x})[0]
            for option in options:  # warm, and the same output
                y = sessions[(option, run)].run(None, {"x": x})[0]
                assert np.abs(y - ref).max() < 1e-4, (option, run)
            for _ in range(rounds):
                order = list(options)
                random.shuffle(order)
                for option in order:
                    started = time.perf_counter()
                    sessions[(option, run)].run(None, {"x": x})
                    times.setdefault(f"{option} {run} {batch}", []).append(
                        time.perf_counter() - started)
    print(json.dumps(times))


def _child(*args: str) -> str:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], cwd=REPO,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{args}: {done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ort-weights-probe")
    parser.add_argument("--options", default=",".join(ALL_OPTIONS))
    parser.add_argument("--timed", default=",".join(TIMED))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        {"export": lambda: export(args.dir), "convert": lambda: convert(args.dir),
         "rss": lambda: rss(args.dir, rest[0]),
         "time": lambda: timing(args.dir, rest[0].split(","), int(rest[1]))}[what]()
        return
    if len(glob.glob(os.path.join(args.dir, "run*.onnx"))) != 39:
        _child("--dir", args.dir, "--child", "export")
    if len(glob.glob(os.path.join(args.dir, "run*.ort"))) != 39:
        _child("--dir", args.dir, "--child", "convert")
    mib = 2 ** 20
    rows = {}
    for option in args.options.split(","):
        rows[option] = json.loads(_child("--dir", args.dir, "--child", "rss", option))
    timed = [o for o in args.timed.split(",") if o]
    times = json.loads(_child("--dir", args.dir, "--child", "time", ",".join(timed),
                              str(args.rounds))) if timed else {}
    print(f"resnet18 224 px, 39 runs, ORT {__import__('onnxruntime').__version__}, "
          f"{THREADS} threads; MiB of resident set the process grew by")
    print(f"{'option':20} {'39 sessions':>11} {'per session*':>12} {'weights held':>12} "
          f"{'make s':>7}")
    for option, row in rows.items():
        print(f"{option:20} {row['ran'] / mib:11.0f} {row['made_after_first'] / mib:12.1f} "
              f"{row['weights'] / mib:12.1f} {row['seconds']:7.1f}")
    print("* median growth making one session after the first (before its first call)")
    if times:
        print("\nms per call: median [p10-p90]")
        header = "".join(f"{run.split('_', 1)[1] + ' b' + str(b):>22}"
                         for b in (1, 8) for run in TIMED_RUNS)
        print(f"{'option':20}{header}")
        for option in timed:
            cells = []
            for b in (1, 8):
                for run in TIMED_RUNS:
                    v = sorted(times[f"{option} {run} {b}"])
                    p10, p90 = v[len(v) // 10], v[(9 * len(v)) // 10 - (len(v) % 10 == 0)]
                    cells.append(f"{1e3 * statistics.median(v):7.1f} [{1e3 * p10:.1f}-"
                                 f"{1e3 * p90:.1f}]")
            print(f"{option:20}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
