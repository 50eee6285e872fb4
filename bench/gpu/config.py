"""What the GPU run measures: models, shapes, dtypes, batch sizes, budgets, load; the full run on
CUDA and the QUICK rehearsal on the CPU.

The full run is sized for an H100 or H200 so that the device calls (docs/gpu.md) end inside their
10 minutes: the paper's request size of 12 and 15-40 MB budgets' spirit (``auto``: from where
fbs-best runs one sample to where fbs runs the request), profiles up to B = 32. Items are in
priority order, each with an estimate of its seconds: a step whose deadline runs short skips
the last ones, float16 before float32's are lost. QUICK keeps every step and every code path
with small inputs, B = 4 and few budgets, so that CI runs it all in a few minutes on 2 cores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    """The service under load, then under load while a second process gives memory back in
    steps (bench/gpu/reach.py says why it must be so)."""

    run: Run
    clients: int
    samples: int
    duration_s: float                 # the steady window: samples/s at the limit, no hog
    warmup_s: float
    margin: str                       # vbs serve --memory-margin; --memory-limit is budget + it
    steps: tuple[float, ...]          # the hog leaves the margin and these shares of the budget
    hold_s: float                     # each step
    lead_s: float                     # the first step's more: the load starts in it
    tail_s: float                     # the load after the hog gave everything back
    idle_s: float                     # the service's VBS_DEVICE_CACHE_IDLE_S
    hog_cap: str = "0"                # the hog's --memory-limit (the CPU's: this machine is shared)
    moving: tuple[str, ...] = ("vbs",)  # the tables whose served run the hog moves
    pages: int = 5                    # the plans' budget: at least this many large pages ...
    within: float = 0.03              # ... the smallest within this of the best gain there
    k: int = 3                        # distinct plan peaks the moving run must show
    offline_repeat: int = 3           # `vbs bench` of the same plans at the budget
    plan_s: float = 70.0              # estimates, for the deadline: `vbs plan`
    steady_s: float = 40.0            # one solver's service, ready to stopped, steady window
    moving_s: float = 30.0            # the moving window
    offline_s: float = 30.0
    snapshots_s: float = 35.0

    @property
    def needed_s(self) -> float:
        """What the step needs to start: the plan, both steady windows, one moving window."""
        return self.plan_s + 2 * self.steady_s + self.moving_s * len(self.moving)


@dataclass(frozen=True)
class Smoke:
    """CUDA graphs captured in the bench's and the profiler's orders on a small model
    (bench/gpu/smoke.py): a failure there stops the call before its benches."""

    model: str = "resnet18"
    shape: tuple[int, ...] = (3, 64, 64)
    estimate_s: float = 60.0
    timeout_s: float = 150.0


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
    smoke: Smoke = Smoke()
    tests_estimate_s: float = 60.0    # the gpu tests (the suites' own check is apart)
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


# per model, seconds a bench takes on an H200, with graphs (3 rounds, 5 budgets; c3d 4) and
# eager: the deadline's estimates (scaled from the runs of 2026-11-28, docs/gpu.md), sized so
# that the five float32 graph benches and the served run fit one call (docs/gpu.md)
BENCH_S = {"googlenet": (65, 30), "resnet50": (55, 30), "squeezenet1_0": (85, 25),
           "mobilenet_v2": (65, 40), "c3d": (80, 25)}


def bench_pairs(text: str | None, runtimes: tuple[str, ...] = (GRAPHS, RUNTIME),
                dtypes: tuple[str, ...] = DTYPES) -> tuple[tuple[str, str], ...]:
    """The benches' (runtime, dtype) in run order: ``text`` ``cudagraph:float16,torch:float32``,
    else every runtime (outer) with every dtype."""
    if not text:
        return tuple((rt, d) for rt in runtimes for d in dtypes)
    pairs = tuple(tuple(p.strip().split(":", 1)) for p in text.split(",") if p.strip())
    bad = [":".join(p) for p in pairs if len(p) != 2 or p[0] not in (GRAPHS, RUNTIME)
           or p[1] not in DTYPES]
    if bad or not pairs:
        raise SystemExit(f"--benches {text!r}: use a comma list of RUNTIME:DTYPE, RUNTIME one of "
                         f"{GRAPHS}, {RUNTIME}, DTYPE one of {', '.join(DTYPES)}")
    return pairs  # type: ignore[return-value]


def full(device: str = "cuda", dtypes: tuple[str, ...] = DTYPES, suites: bool = True,
         benches: tuple[tuple[str, str], ...] | None = None) -> Config:
    """The GPU run (its figures are the ones docs/benchmarks.md takes). ``dtypes`` narrows the
    profiles and benches (a short lease: float32 first); ``benches`` the benches' (runtime,
    dtype), in order; ``suites`` False runs only the tests marked gpu."""
    profiles = tuple(Run(m, dtype=d, batch_max=32, estimate_s=90 if m == "c3d" else 60,
                         runtime=GRAPHS)
                     for d in dtypes for m in ("squeezenet1_0", "mobilenet_v2", "googlenet",
                                               "resnet50", "c3d"))
    # with graphs first (the figures issue 44 asks for), eager after (the record's other rows)
    benches = tuple(Run(m, dtype=d, batch=12, batch_max=12,
                        memory="auto:4" if m == "c3d" else "auto:5", repeat=3,
                        estimate_s=BENCH_S[m][0 if rt == GRAPHS else 1], runtime=rt)
                    for rt, d in (benches or bench_pairs(None, dtypes=dtypes)) for m in MODELS)
    graphs = tuple(Run(m, dtype=d, batch=1, batch_max=1, repeat=50, estimate_s=30)
                   for d in dtypes for m in ("resnet50", "mobilenet_v2"))
    energy = tuple(Run(m, batch=12, batch_max=12, memory="auto:4", repeat=3, estimate_s=120)
                   for m in ("googlenet", "resnet50"))
    # the budget at least five large pages (reach.py), and one page of margin beside it for
    # the batches' inputs while the hog leaves the service little; the hog starts after the
    # service's cache was given back and gives memory back in steps
    serve = Serve(Run("resnet50", batch_max=16), clients=16, samples=1,
                  duration_s=15, warmup_s=3, margin="20MiB", steps=(0.3, 0.55, 0.8),
                  hold_s=3.0, lead_s=2.5, tail_s=3.0, idle_s=1.0)
    serve = replace(serve, run=replace(serve.run, estimate_s=serve.needed_s))
    return Config(device=device, quick=False, profile_repeats=5, profile_warmup=2,
                  profiles=profiles, benches=benches, energy=energy, serve=serve,
                  graphs=graphs, full_suites=suites, tests_estimate_s=300.0,
                  smoke=Smoke(estimate_s=30.0))


def quick(device: str = "cpu") -> Config:
    """The rehearsal: every step and code path, small (CI runs it on 2 cores)."""
    small = (3, 64, 64)
    # a chain, a model of blocks, float16 and video (`make test` profiles the rest; the full
    # run's C3D at its 16 frames of 112x112 took half the rehearsal's profile step: video small)
    profiles = (*(Run(m, small, batch_max=4, estimate_s=15) for m in ("squeezenet1_0", "googlenet")),
                Run("squeezenet1_0", small, dtype="float16", batch_max=4, estimate_s=15),
                Run("r3d_18", (3, 4, 32, 32), batch_max=2, estimate_s=15))
    # eager torch, and the runtime of calls this device has (auto: ONNX Runtime on the CPU,
    # CUDA graphs on CUDA): the summary sets the two side by side
    benches = tuple(Run(m, small, batch=4, batch_max=4, memory="auto:3", repeat=1,
                        estimate_s=40, runtime=rt)
                    for m, rt in (("squeezenet1_0", "torch"), ("squeezenet1_0", "auto")))
    graphs = (Run("squeezenet1_0", small, batch=1, batch_max=1, repeat=5, estimate_s=15),)
    energy = (Run("squeezenet1_0", small, batch=4, batch_max=4, memory="auto:3", repeat=1,
                  estimate_s=30),)
    serve = Serve(Run("squeezenet1_0", small, batch_max=4), clients=4, samples=1,
                  duration_s=2, warmup_s=0.5, margin="0", steps=(0.3, 0.6), hold_s=0.5,
                  lead_s=0.3, tail_s=0.5, idle_s=0.2, hog_cap="128MiB", offline_repeat=1,
                  plan_s=20, steady_s=15, moving_s=10, offline_s=15, snapshots_s=10)
    serve = replace(serve, run=replace(serve.run, estimate_s=serve.needed_s))
    return Config(device=device, quick=True, profile_repeats=1, profile_warmup=0,
                  profiles=profiles, benches=benches, energy=energy, serve=serve,
                  graphs=graphs, full_suites=False, energy_min_window_s=0.01,
                  smoke=Smoke(estimate_s=20, timeout_s=120))


def config(device: str, quick_run: bool, dtypes: tuple[str, ...] = DTYPES,
           suites: bool = True, runtimes: tuple[str, ...] = (GRAPHS, RUNTIME),
           benches: str | None = None) -> Config:
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise SystemExit(f"--dtypes {','.join(dtypes)!r}: use a comma list of {', '.join(DTYPES)}")
    if not runtimes or any(r not in (GRAPHS, RUNTIME) for r in runtimes):
        raise SystemExit(f"--runtimes {','.join(runtimes)!r}: use a comma list of {GRAPHS}, "
                         f"{RUNTIME}")
    pairs = bench_pairs(benches, runtimes, dtypes)
    return quick(device) if quick_run else full(device, dtypes, suites, pairs)
