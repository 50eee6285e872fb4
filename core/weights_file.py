"""A compiled model's unit weights in a file of their own, out of the process's heap.

Why: a worker without torch keeps every unit's graph, to compose any run a plan may call, and
their weights sat in its heap beside the copy its sessions share (``core.runtimes.ort_weights``):
each weight twice, for as long as the model stayed loaded. Written once, as the model is read,
to a file that is unlinked at once (nothing is left behind, whatever ends the process), and
read back one tensor at a time when a session is made, they are page cache, which the kernel
drops under a memory limit before it kills anything, not memory the model keeps. The folder
must be on a disk (a tmpfs would hold them in memory again): the server's cache directory.

The sessions' own files (``core.runtimes.ort_weights``) live in a folder beside it while their
model is loaded; a process killed before it removes its folder leaves it behind, so each such
folder holds a lock its process keeps (``owned_folder``), and `vbs serve` removes, as it starts,
the folders whose lock no process holds (``ready_folder``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any

import onnx

from core.errors import UsageError

LOCATION = "vbs-weights-file"  # what a moved tensor's external data names: this file
_ALIGN = 64


_OWNER = "owner.lock"  # in an owned folder: locked (flock) by the process it belongs to
SESSIONS_PREFIX = "vbs-ort-weights-"  # the folder of a model's sessions' files (ort_weights)


def owned_folder(prefix: str, folder: str | os.PathLike[str] | None = None) -> tuple[str, int]:
    """A new folder in ``folder`` named ``prefix`` and a random part, with a lock held on the
    descriptor returned: the folder is this process's while that descriptor is open (close it
    after removing the folder). Made under a hidden name and renamed once locked, so a sweep
    never sees it unlocked."""
    staging = tempfile.mkdtemp(prefix="." + prefix, dir=folder)
    fd = os.open(os.path.join(staging, _OWNER), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    final = os.path.join(os.path.dirname(staging), os.path.basename(staging)[1:])
    os.rename(staging, final)
    return final, fd


def remove_owned(path: str, fd: int) -> None:
    """Remove a folder ``owned_folder`` made, then let its lock go."""
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


def sweep(folder: str | os.PathLike[str], prefix: str) -> list[str]:
    """Remove the folders named ``prefix``... in ``folder`` whose owner's lock no process
    holds (its process ended without removing it); the paths removed. A folder without a lock
    file (made by an older version) is left alone."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(os.path.join(entry.path, _OWNER), os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its process is alive
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


def ready_folder(folder: str | os.PathLike[str], prefixes: tuple[str, ...], setting: str
                 ) -> list[str]:
    """Make ``folder`` (where loaded models' weights files and sessions' folders go) and check
    that a file can be written there, naming ``setting`` if not; remove what killed processes
    left there (``sweep`` of each prefix); the paths removed."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UsageError(f"{setting}: cannot write the loaded models' weights files in {folder} "
                         f"({exc.strerror or exc}): give a writable directory on a disk") from exc
    return [path for prefix in prefixes for path in sweep(folder, prefix)]


class WeightsFile:
    """Tensors' bytes appended to an unlinked file in ``folder`` (``put``), read back by
    offset (``read``); the file lives while this object does."""

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="vbs-weights-", dir=folder)
        self.folder = os.path.dirname(path)  # where it was made (files beside it may go there)
        os.unlink(path)
        self._fd = fd
        self._end = 0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def nbytes(self) -> int:
        return self._end

    def put(self, raw: bytes) -> int:
        """Append ``raw``; its offset."""
        with self._lock:
            offset = -(-self._end // _ALIGN) * _ALIGN
            view = memoryview(raw)
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
            self._end = offset + len(raw)
        return offset

    def read(self, offset: int, length: int) -> bytes:
        """The ``length`` bytes at ``offset``."""
        parts, done = [], 0
        while done < length:
            part = os.pread(self._fd, length - done, offset + done)
            if not part:
                raise OSError(f"the weights file ends at {offset + done}, before {offset + length}")
            parts.append(part)
            done += len(part)
        _drop(self._fd, offset, length)  # read twice, they would count as the group's in use
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def settle(self) -> None:
        """Write what ``put`` wrote to the disk and drop it from the page cache: a memory
        cgroup counts written pages the kernel would keep (active) as in use."""
        with self._lock:
            os.fdatasync(self._fd)
            _drop(self._fd, 0, 0)

    def moved(self, model: onnx.ModelProto, min_bytes: int) -> onnx.ModelProto:
        """``model`` with each initializer of ``min_bytes`` or more written here and named by
        its place (``tensor_raw`` reads it); ``model`` itself is left as it is."""
        out = onnx.ModelProto()
        copy_fields(model, out, skip="graph")
        copy_fields(model.graph, out.graph, skip="initializer")
        for tensor in model.graph.initializer:
            if not tensor.HasField("raw_data") or tensor_bytes(tensor) < min_bytes:
                out.graph.initializer.add().CopyFrom(tensor)
                continue
            raw = tensor.raw_data
            offset = self.put(raw)
            shell = out.graph.initializer.add()
            shell.name, shell.data_type = tensor.name, tensor.data_type
            shell.dims.extend(tensor.dims)
            refer(shell, LOCATION, offset, len(raw))
        return out

    def tensor_raw(self, tensor: onnx.TensorProto) -> bytes:
        """The bytes of a tensor ``moved`` wrote here."""
        info = {e.key: e.value for e in tensor.external_data}
        if info.get("location") != LOCATION:
            raise ValueError(f"{tensor.name}: its bytes are not in this weights file")
        return self.read(int(info["offset"]), int(info["length"]))


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """A tensor's bytes by its type and shape (a moved one's too)."""
    size = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    count = 1
    for d in tensor.dims:
        count *= d
    return size * count


def is_moved(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor``'s bytes are in a ``WeightsFile`` (``moved``)."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == LOCATION for e in tensor.external_data)


def _drop(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to drop a range's clean pages from the page cache (0: to the end)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def refer(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``tensor`` external data at ``location`` (its bytes dropped from the graph)."""
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = k, v


def copy_fields(source: Any, target: Any, *, skip: str) -> None:
    """Every field of the message ``source`` set on ``target`` too, but ``skip``."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)
