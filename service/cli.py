"""``vbs serve`` (the HTTP service under uvicorn) and ``vbs loadtest`` (a local load test)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from planner.cli import add_precision_args, add_runtime_arg, positive_int
from core.errors import UsageError

log = logging.getLogger("vbs.service")


def _seconds(text: str, *, zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value >= 0 if zero else value > 0) or value != value:
        raise argparse.ArgumentTypeError(f"{value} must be {'>=' if zero else '>'} 0")
    return value


def _warmup(text: str) -> float:
    return _seconds(text, zero=True)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve models over HTTP (POST /infer, OIP v2, GET /plan) "
                                     "and gRPC (OIP v2)",
                       description="Serve models over HTTP and gRPC (the Open Inference Protocol "
                                   "v2); every batch runs the plan for the memory free when it "
                                   "runs. Flags override VBS_* settings.")
    p.add_argument("--model", action="append", metavar="[ALIAS=]NAME[@C,H,W]",
                   help="a model to serve (repeat for several); default: VBS_MODELS")
    p.add_argument("--input-shape", help="per-sample input shape for models given without @shape")
    p.add_argument("--weights", help="a state_dict file loaded (weights_only) into the model(s)")
    p.add_argument("--store", help="plan store: redis://host:port/db or a directory "
                                   "(default: VBS_STORE, else <cache_dir>/store)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--grpc-port", type=int, help="port of the Open Inference Protocol v2 over "
                                                 "gRPC, on the same host (default 8001, as "
                                                 "Triton's; 0 serves no gRPC)")
    p.add_argument("--memory-limit", help="most memory a plan may use, e.g. 64MB (default: free)")
    p.add_argument("--memory-margin", help="memory kept back from plans, e.g. 16MB")
    p.add_argument("--models-memory", help="most memory the models take together (what loaded "
                                           "models keep and their plans), e.g. 2GB: models load "
                                           "on demand within it, the least recently used idle "
                                           "one unloaded for another (default: the device's)")
    p.add_argument("--memory-sharing", choices=["arbiter", "static", "none"],
                   help="how models on one device share its memory (default arbiter)")
    p.add_argument("--cpu-model-threads", choices=["shared", "per_model"],
                   help="on the CPU: one torch thread for every model (default), or one each")
    p.add_argument("--batch-max", type=positive_int, help="largest request size planned (default 16)")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--solver", choices=["vbs", "paper", "fbs", "fbs-best", "greedy"])
    add_runtime_arg(p)
    add_precision_args(p)  # the tables of that precision (a torch worker captures it so)
    p.add_argument("--first-start", choices=["interim", "wait"],
                   help="a model the store has no table for: served at once from an interim "
                        "table while `vbs plan` plans it beside (interim), or planned first "
                        "(wait; the default, VBS_FIRST_START)")
    p.add_argument("--max-batch-delay-ms", type=float, help="longest wait to gather a batch")
    p.add_argument("--latency-target", type=_seconds, help="gather only what a plan runs within "
                                                           "this many seconds")
    p.add_argument("--max-queue", type=positive_int, help="waiting requests per model before 503")
    p.add_argument("--request-timeout", type=_seconds, help="seconds before a request gets 504")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("loadtest", help="load-test a local vbs serve with concurrent clients",
                       description="N concurrent clients for T seconds against a vbs serve on "
                                   "this machine (loopback only).")
    p.add_argument("--url", help="the service (loopback only; default http://127.0.0.1:8000, "
                                 "with --protocol grpc 127.0.0.1:8001)")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http",
                   help="HTTP (POST /infer, --format) or the OIP v2 over gRPC (ModelInfer, raw "
                        "tensors)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--clients", type=positive_int, help="concurrent clients (<= 256; default 4)")
    p.add_argument("--duration", type=_seconds, default=10.0, help="seconds (<= 600)")
    p.add_argument("--samples", type=positive_int, default=1, help="samples per request")
    p.add_argument("--format", choices=["npy", "json", "oip"],
                   help="request encoding over HTTP (default npy; the client processes send oip: "
                        "OIP v2 with binary tensors)")
    g = p.add_argument_group("client processes", "any of these runs the load in separate client "
                             "processes (loadgen.processes), requests encoded beforehand, each "
                             "reporting its own CPU")
    g.add_argument("--processes", type=int, help="client processes (default 1)")
    g.add_argument("--concurrency", type=int, help="closed loop: requests in flight in all "
                   "(default --clients; give at least twice the largest batch)")
    g.add_argument("--rate", type=float, help="open loop: requests a second in all, each sent at "
                   "its time whether or not earlier ones were answered")
    g.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson",
                   help="the open loop's arrivals: Poisson (default) or a fixed interval")
    g.add_argument("--cpus", help="pin the client processes to these CPUs, e.g. 1 or 2-3")
    p.add_argument("--warmup", type=_warmup, default=0.0,
                   help="seconds of load before counting starts (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_loadtest)


_FLAGS = {"store": "store", "weights": "weights", "host": "host", "port": "port",
          "grpc_port": "grpc_port", "memory_limit": "memory_limit_bytes",
          "memory_margin": "memory_margin_bytes", "models_memory": "models_memory_bytes",
          "memory_sharing": "memory_sharing",
          "cpu_model_threads": "cpu_model_threads", "batch_max": "batch_max", "device": "device",
          "dtype": "dtype", "solver": "solver", "max_batch_delay_ms": "max_batch_delay_ms",
          "latency_target": "latency_target_s", "max_queue": "max_queue",
          "request_timeout": "request_timeout_s", "runtime": "runtime",
          "first_start": "first_start", "precision": "precision", "calibration": "calibration",
          "max_error": "max_error"}


def serve_settings(args: argparse.Namespace) -> Any:
    """Settings from the environment, overridden by the flags given."""
    from service.settings import Settings

    overrides: dict[str, Any] = {field: getattr(args, flag) for flag, field in _FLAGS.items()
                                 if getattr(args, flag, None) is not None}
    try:
        if args.model:
            overrides["models"] = list(args.model)
        if args.input_shape:
            models = overrides.get("models") or Settings(**overrides).models
            overrides["models"] = [m if "@" in m else f"{m}@{args.input_shape}" for m in models]
        settings = Settings(**overrides)
    except ValueError as exc:
        raise UsageError(f"invalid setting: {' '.join(str(exc).split())}") from exc
    if not settings.models:
        raise UsageError("no model to serve: give --model NAME (or set VBS_MODELS)")
    return settings


def cmd_serve(args: argparse.Namespace) -> int:
    settings = serve_settings(args)
    if settings.hugepages:  # before anything heavy is imported: it is all imported again
        _restart_with_hugepages()
    from core.weights_file import SESSIONS_PREFIX, ready_folder

    # where loaded models keep their weights files: writable, and rid of what a killed
    # server left there
    swept = ready_folder(settings.cache_dir / "weights", (SESSIONS_PREFIX,), "VBS_CACHE_DIR")
    from core.spec import ModelSpec
    from planner.store import printable_location
    from service.grpc_server import run as run_server
    from service.main import create_app
    from service.fast.protocol import http_protocol

    specs = [(served, ModelSpec(name=name, input_shape=shape, dtype=settings.dtype,
                                device=settings.device, weights=settings.weights))
             for served, name, shape in settings.served_models]
    if settings.lean_for(settings.device):
        _check_compiled(settings, specs)
    else:
        # fail fast on a model that cannot load: each built on the meta device, its weights
        # file read there too (no memory: more models than memory holds load on demand); a
        # model the store holds compiled is served without torch, and not built here either
        # (torch is imported only for a model that needs it)
        built = [spec for served, spec in specs
                 if not (settings.lean_if_compiled(settings.device)
                         and _compiled_in_store(settings, served, spec))]
        if built:
            try:
                from planner.models import sketch_model
            except ImportError:  # torch is there but fails to import: as a server without it
                _check_compiled(settings, specs)
            else:
                for spec in built:
                    sketch_model(spec, check_weights=True)
    logging.getLogger("vbs").setLevel(args.log_level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for path in swept:
        log.info("removed %s: a server that ended without removing it left it", path)
    log.info("serving %s on http://%s:%d%s (store %s)", ", ".join(settings.models),
             settings.host, settings.port,
             f" and gRPC port {settings.grpc_port}" if settings.grpc_port else "",
             printable_location(settings.store_location))
    run_server(create_app(settings), host=settings.host, port=settings.port,
               http=http_protocol(settings.fast_path),
               log_level=args.log_level, access_log=settings.access_log,
               timeout_graceful_shutdown=int(settings.request_timeout_s) + 5)
    return 0


def _restart_with_hugepages() -> None:
    """Start this program again, as it was started, with glibc's huge-page tunable
    (``core.malloc.hugepages_env``; glibc reads it only when a process starts), where it is
    not set: the process keeps its PID, its cgroup and its parent. Only when `vbs serve` is
    the program (not ``main([...])`` called inside another), and only once: the tunable is
    set then."""
    import os
    import sys

    from core.malloc import HUGETLB, hugepages_env

    argv = list(getattr(sys, "orig_argv", ()))
    if "serve" not in sys.argv[1:3] or not argv:
        return
    env = hugepages_env(os.environ)
    if env is None:
        return
    print(f"vbs serve: starting again with GLIBC_TUNABLES={HUGETLB}=1 (large buffers in "
          "transparent huge pages; VBS_HUGEPAGES=false: never)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError as exc:  # serve as it is
        log.warning("could not start again with huge pages: %s", exc)


def _compiled_in_store(settings: Any, served: str, spec: Any) -> bool:
    """Whether the store holds ``served`` compiled (False where it cannot be read now: the
    model is then checked as one served with torch)."""
    from core.errors import StoreError
    from planner.store import open_store
    from planner.stored import compiled_key

    try:
        store = open_store(settings.store_location)
    except StoreError:
        return False
    try:
        return store.get_model(compiled_key(served, spec)) is not None
    except StoreError:
        return False
    finally:
        store.close()


def _check_compiled(settings: Any, specs: list[tuple[str, Any]]) -> None:
    """Served without torch: fail fast on a model the store holds no compiled form of (a
    store that is down is waited for by the loads, as always)."""
    from core.errors import StoreError
    from planner.store import open_store
    from planner.stored import compiled_key, plan_hint

    try:
        store = open_store(settings.store_location)
    except StoreError:
        return
    try:
        for served, spec in specs:
            if store.get_model(compiled_key(served, spec)) is None:
                raise UsageError(f"{served}: the store {store.location} holds no compiled model "
                                 f"of it, and this server runs without torch (VBS_LEAN="
                                 f"{settings.lean}): {plan_hint(served, spec, store.location)}")
    except StoreError:
        return
    finally:
        store.close()


def cmd_loadtest(args: argparse.Namespace) -> int:
    """The load generator (``loadgen/``, a client beside the server, imported only here and only
    when the command runs) with the server's API key."""
    from loadgen.cli import run
    from service.settings import Settings

    try:
        key = Settings().api_key
    except ValueError as exc:
        raise UsageError(f"invalid setting: {exc}") from exc
    return run(args, key.get_secret_value() if key is not None else None)
