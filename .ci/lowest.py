"""Print `name==floor` for the dependencies whose lowest allowed release CI tests against.

The floors are read from pyproject.toml (the one place they are declared), so the CI step
`make test-lowest` always installs exactly the lowest versions the project claims to support.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

CHECKED = ("redis", "fastapi", "starlette", "pydantic", "pydantic-settings", "uvicorn",
           "grpcio", "protobuf")


def floors(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(.*)$", dep.split(";")[0].strip())
        name, spec = match.group(1).lower(), match.group(3)
        floor = re.search(r">=\s*([0-9][^,\s]*)", spec)
        if name in CHECKED and floor:
            pins[name] = f"{name}=={floor.group(1)}"
    missing = [name for name in CHECKED if name not in pins]
    if missing:
        sys.exit(f"pyproject.toml declares no >= floor for {', '.join(missing)}")
    return [pins[name] for name in CHECKED]


if __name__ == "__main__":
    print(" ".join(floors(Path(__file__).resolve().parents[1] / "pyproject.toml")))
