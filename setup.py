"""The build step of vbs-serve: the Open Inference Protocol's gRPC service compiled from its .proto.

Everything else about the package is declared in pyproject.toml. ``service/oip/*.proto`` is
compiled with grpcio-tools (a build requirement, pinned in pyproject.toml so that the generated
code and the protobuf and grpcio runtime floors agree) whenever the package is built: into the
wheel's build directory, or, for an editable install (which imports the source tree), beside
the .proto. Generated Python is never checked in (.gitignore).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ("service/oip/grpc_predict_v2.proto",)
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def compile_protos(out: Path) -> list[str]:
    """Compile every proto of ``PROTOS`` into ``out`` (mirroring its path); the files made."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    made = []
    for proto in PROTOS:
        (out / proto).parent.mkdir(parents=True, exist_ok=True)
        status = protoc.main(["grpc_tools.protoc", f"--proto_path={ROOT}",
                              f"--proto_path={well_known}", f"--python_out={out}",
                              f"--pyi_out={out}", f"--grpc_python_out={out}",
                              str(ROOT / proto)])
        if status != 0:
            raise RuntimeError(f"grpc_tools.protoc could not compile {proto} (exit {status}); "
                               "its errors are printed above")
        stem = out / proto.removesuffix(".proto")
        _private_pool(stem.with_name(stem.name + "_pb2.py"))
        made += [str(stem.with_name(stem.name + suffix)) for suffix in GENERATED]
    return made


def _private_pool(module: Path) -> None:
    """Build the generated messages in a descriptor pool of their own, not protobuf's default
    one: tritonclient, kserve and Triton's own Python modules register the same names
    (``inference.ModelInferRequest``, ...) in the default pool, and a second registration there
    fails at import. The wire format is the same either way."""
    text = module.read_text()
    default = "_descriptor_pool.Default().AddSerializedFile("
    if text.count(default) != 1:
        raise RuntimeError(f"{module}: protoc's output no longer registers its file with "
                           f"{default!r} once; update setup.py's _private_pool")
    module.write_text(text.replace(default, "_descriptor_pool.DescriptorPool().AddSerializedFile("))


class BuildPyWithProtos(build_py):
    """``build_py``, then the protocol's modules generated where the built package is read."""

    def run(self) -> None:
        super().run()
        made = compile_protos(ROOT if self.editable_mode else Path(self.build_lib))
        self._protos = [] if self.editable_mode else made

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *getattr(self, "_protos", [])]


setup(cmdclass={"build_py": BuildPyWithProtos})
