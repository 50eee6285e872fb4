"""How many bytes are free for activations right now, on the device a worker runs on.

CUDA: what the driver reports free (``torch.cuda.mem_get_info``) plus what PyTorch's caching
allocator holds but does not use (reserved − allocated): both can be given to a plan.
CPU: the container's cgroup limit minus its usage (cgroup v2 ``memory.max`` −
``memory.current``, or v1 ``memory.limit_in_bytes`` − ``memory.usage_in_bytes``) when a
limit is set, else the kernel's ``MemAvailable``. Either way the result is capped by the
configured limit and a safety margin is kept back, because other allocations (the request
tensors, Python objects, the HTTP stack) happen beside the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as a number close to 2**63


def parse_limit(text: str) -> int | None:
    """A cgroup limit file's content: a number of bytes, or None for no limit."""
    text = text.strip()
    if not text or text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def parse_meminfo(text: str, key: str = "MemAvailable") -> int | None:
    """A field of /proc/meminfo in bytes."""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            return int(parts[1]) * (1024 if len(parts) > 2 and parts[2] == "kB" else 1)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_free(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limit, or None when there is none."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit_text, usage_text = _read(root / limit_file), _read(root / usage_file)
        if limit_text is None or usage_text is None:
            continue
        limit = parse_limit(limit_text)
        if limit is None:
            return None
        return max(0, limit - int(usage_text.strip()))
    return None


def cpu_free(root: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> int:
    """Free memory for a CPU worker: the cgroup's headroom, else MemAvailable."""
    free = cgroup_free(root)
    available = parse_meminfo(_read(meminfo) or "")
    if free is None:
        return available or 0
    return min(free, available) if available is not None else free


def cuda_free(device: int | str = 0) -> int:
    """Free memory on a CUDA device, counting what the caching allocator holds unused."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))


def release_cached(device: str) -> None:
    """Give the blocks PyTorch's caching allocator holds unused back to the device (CUDA only;
    call it once the tensors of a failed attempt are gone, or they stay cached)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


@dataclass
class MemoryProbe:
    """Bytes free for activations now: the device's free memory, capped, minus a margin.

    ``limit`` is the most a plan may use whatever the device has free (0 = no cap); it can
    be changed while serving (a smaller limit makes later batches step down to plans that
    fit). ``margin`` is kept back for everything that is not a plan's activations.
    """

    device: str = "cpu"
    limit: int = 0
    margin: int = 0
    source: Callable[[], int] | None = None  # overrides the device reading (e.g. a cgroup root)

    def device_free(self) -> int:
        if self.source is not None:
            return self.source()
        if self.device.startswith("cuda"):
            return cuda_free(self.device)
        return cpu_free()

    def free(self) -> int:
        free = self.device_free()
        if self.limit:
            free = min(free, self.limit)
        return max(0, free - self.margin)
