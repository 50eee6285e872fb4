"""What the GPU run measures: models, shapes, dtypes, batch sizes, budgets, load; the full run on
CUDA and the QUICK rehearsal on the CPU.

The full run is sized for an H100 so that each device call (docs/gpu.md) ends well inside its
10 minutes: the paper's request size of 12 and 15-40 MB budgets' spirit (``auto``: from where
fbs-best runs one sample to where fbs runs the request), profiles up to B = 32. Items are in
priority order: a step whose deadline runs short skips the last ones, float16 before float32's
are lost. QUICK keeps every step and every code path with small inputs, B = 4 and few budgets,
so that CI runs it all in a few minutes on 2 cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODELS = ("googlenet", "resnet50", "squeezenet1_0", "mobilenet_v2", "c3d")  # the paper's, as here
DTYPES = ("float32", "float16")
# the steps' runtime where an item names none (serve, energy): eager torch. Profiles and
# benches run CUDA graphs (``cudagraph``: runs replayed as graphs beside eager steps, fbs and
# fbs-best as one graph per phase) and, for the record, eager torch alone. ONNX Runtime on the
# GPU machine is a CPU build.
RUNTIME = "torch"
GRAPHS = "cudagraph"


@dataclass(frozen=True)
class Run:
    """One model run of a step: which model, on what input, and how much."""

    model: str
    shape: tuple[int, ...] | None = None  # per sample; None: the model's own
    dtype: str = "float32"
    batch_max: int = 12
    batch: int = 12              # request size (bench, energy)
    memory: str = "auto:6"       # budgets (bench, energy): vbs bench's --memory
    repeat: int = 5              # interleaved rounds (bench, energy)
    estimate_s: float = 60.0     # what the item takes on its device, for the deadline
    runtime: str = ""            # --runtime (profile, bench); '' = the config's

    @property
    def label(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "default"
        return f"{self.model}@{shape}/{self.dtype}" + (f"/{self.runtime}" if self.runtime else "")

    @property
    def shape_arg(self) -> list[str]:
        return ["--input-shape", ",".join(map(str, self.shape))] if self.shape else []

    @property
    def entry(self) -> str:
        """As ``vbs serve --model`` takes it."""
        return f"{self.model}@{'x'.join(map(str, self.shape))}" if self.shape else self.model


@dataclass(frozen=True)
class Serve:
    """The service under load with a second process taking and freeing memory."""

    run: Run
    clients: int
    samples: int
    duration_s: float
    warmup_s: float
    margin: str                       # vbs serve --memory-margin
    hog: tuple[str, ...]  # bench/memory_hog.py arguments; a size "Nx" is N times the limit
    hold_s: float
    gap_s: float


@dataclass(frozen=True)
class Config:
    device: str
    quick: bool
    profile_repeats: int
    profile_warmup: int
    profiles: tuple[Run, ...]
    benches: tuple[Run, ...]
    energy: tuple[Run, ...]
    serve: Serve
    graphs: tuple[Run, ...]           # one-sample passes: the whole model as one graph, and eager
    full_suites: bool                 # the core, planner and workers suites run (else only collected)
    energy_window_ticks: float = 5.0
    energy_min_window_s: float = 0.05
    runtime: str = RUNTIME

    def runtime_of(self, item: Run) -> str:
        return item.runtime or self.runtime

    def vbs_env(self, work: Path) -> dict[str, str]:
        """The settings every vbs command of the run gets: its own profile cache (nothing
        from earlier runs is reused) and the profile's repeats."""
        return {"VBS_CACHE_DIR": str(work / "cache"), "VBS_PROFILE_REPEATS": str(self.profile_repeats),
                "VBS_PROFILE_WARMUP": str(self.profile_warmup), "VBS_RUNTIME": self.runtime}


def full(device: str = "cuda", dtypes: tuple[str, ...] = DTYPES, suites: bool = True) -> Config:
    """The GPU run (its figures are the ones docs/benchmarks.md takes). ``dtypes`` narrows the
    profiles and benches (a short lease: float32 first); ``suites`` False runs only the tests
    marked gpu."""
    profiles = tuple(Run(m, dtype=d, batch_max=32, estimate_s=90 if m == "c3d" else 60,
                         runtime=GRAPHS)
                     for d in dtypes for m in ("squeezenet1_0", "mobilenet_v2", "googlenet",
                                               "resnet50", "c3d"))
    # with graphs first (the figures issue 44 asks for), eager after (the record's other rows)
    benches = tuple(Run(m, dtype=d, batch=12, batch_max=12,
                        memory="auto:4" if m == "c3d" else "auto:6",
                        repeat=3 if m == "c3d" else 5, estimate_s=90 if m == "c3d" else 60,
                        runtime=rt)
                    for rt in (GRAPHS, RUNTIME) for d in dtypes for m in MODELS)
    graphs = tuple(Run(m, dtype=d, batch=1, batch_max=1, repeat=50, estimate_s=30)
                   for d in dtypes for m in ("resnet50", "mobilenet_v2"))
    energy = tuple(Run(m, batch=12, batch_max=12, memory="auto:4", repeat=3, estimate_s=120)
                   for m in ("googlenet", "resnet50"))
    serve = Serve(Run("resnet50", batch_max=16, estimate_s=180), clients=16, samples=1,
                  # no margin: the limit is the table's tight end (~20 MB for resnet50), and
                  # the probe takes a margin off the capped figure (64 MiB left 0 on an H200)
                  duration_s=40, warmup_s=5, margin="0",
                  hog=("--leave", "2x,1x,0.5x,0.25x"), hold_s=1.0, gap_s=1.0)
    return Config(device=device, quick=False, profile_repeats=5, profile_warmup=2,
                  profiles=profiles, benches=benches, energy=energy, serve=serve,
                  graphs=graphs, full_suites=suites)


def quick(device: str = "cpu") -> Config:
    """The rehearsal: every step and code path, small (CI runs it on 2 cores)."""
    small = (3, 64, 64)
    profiles = (*(Run(m, small, batch_max=4, estimate_s=15)
                  for m in ("squeezenet1_0", "mobilenet_v2", "googlenet", "resnet50")),
                Run("squeezenet1_0", small, dtype="float16", batch_max=4, estimate_s=15),
                Run("c3d", batch_max=2, estimate_s=30))
    # eager torch, and the runtime of calls this device has (auto: ONNX Runtime on the CPU,
    # CUDA graphs on CUDA): the summary sets the two side by side
    benches = tuple(Run(m, small, batch=4, batch_max=4, memory="auto:3", repeat=1,
                        estimate_s=40, runtime=rt)
                    for m, rt in (("squeezenet1_0", "torch"), ("squeezenet1_0", "auto")))
    graphs = (Run("squeezenet1_0", small, batch=1, batch_max=1, repeat=5, estimate_s=15),)
    energy = (Run("squeezenet1_0", small, batch=4, batch_max=4, memory="auto:3", repeat=1,
                  estimate_s=30),)
    serve = Serve(Run("squeezenet1_0", small, batch_max=4, estimate_s=60), clients=4, samples=1,
                  duration_s=4, warmup_s=1, margin="0",
                  hog=("--take", "128MiB,64MiB", "--memory-limit", "128MiB"), hold_s=0.5,
                  gap_s=0.5)
    return Config(device=device, quick=True, profile_repeats=1, profile_warmup=0,
                  profiles=profiles, benches=benches, energy=energy, serve=serve,
                  graphs=graphs, full_suites=False, energy_min_window_s=0.01)


def config(device: str, quick_run: bool, dtypes: tuple[str, ...] = DTYPES,
           suites: bool = True) -> Config:
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise SystemExit(f"--dtypes {','.join(dtypes)!r}: use a comma list of {', '.join(DTYPES)}")
    return quick(device) if quick_run else full(device, dtypes, suites)
