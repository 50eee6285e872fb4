"""The one exception tree of vbs-serve.

Every error says what was wrong and what to do about it. Foreign errors (torch, redis,
OS, JSON) are translated where they cross into our code with ``raise ... from exc``, so
callers only ever catch these::

    VbsError
    ├── UsageError              bad input from a user: a flag, a size, a shape
    │   ├── RequestTooLargeError    a request would not fit a memory limit even alone
    │   └── ModelError          the model cannot be loaded, built or run as given
    │       ├── TraceError          torch.fx cannot capture the model
    │       └── BatchMixingError    an op mixes samples of a batch
    ├── ProfileError            a profile is malformed or cannot be measured
    ├── PlanError               the solver or simulator rejects a request
    │   ├── InfeasibleError         no schedule fits the memory budget
    │   │   └── LeaseTimeoutError       a batch waited too long for its memory lease
    │   └── InvalidProgramError     a program breaks the model of memory or its order
    ├── StoreError              the plan store cannot be reached or holds bad data
    │   ├── TableNotFoundError      no table is stored for a fingerprint
    │   └── TableFormatError        stored data (a table, its meta, version or alias) is
    │                               malformed or of an old schema: never retried
    └── ExecutionError          a plan failed while running on the device
        └── OutOfMemoryError        the device ran out of memory running a plan
"""

from __future__ import annotations


class VbsError(Exception):
    """Base of every error vbs-serve raises on purpose."""


class UsageError(VbsError):
    """A flag, size, shape or name given by the user is not valid."""


class RequestTooLargeError(UsageError):
    """A request would not fit in the memory limit even with nothing else held (the message
    names the field, the limit and what to send instead)."""


class ModelError(UsageError):
    """The model cannot be loaded, built or run as given."""


class TraceError(ModelError):
    """torch.fx cannot capture the model as a graph of units."""


class BatchMixingError(ModelError):
    """An op mixes samples of a batch, so the batch cannot be split across layers."""


class ProfileError(VbsError):
    """A profile is malformed, inconsistent or cannot be measured."""


class PlanError(VbsError):
    """The solver or the simulator rejects a request."""


class InfeasibleError(PlanError):
    """No schedule fits in the memory budget."""


class LeaseTimeoutError(InfeasibleError):
    """A batch waited longer than its timeout for the memory arbiter to lease it a plan's
    bytes (the other models' batches held them all that time)."""


class InvalidProgramError(PlanError):
    """A program breaks the model of memory or the order of its units."""


class StoreError(VbsError):
    """The plan store cannot be reached or holds data that cannot be read."""


class TableNotFoundError(StoreError):
    """No plan table is stored for the requested fingerprint."""


class TableFormatError(StoreError):
    """Stored data (a plan table, its meta, its version counter, a model alias, a profile) is of
    an old schema or malformed. The message names the key. Retrying cannot help: re-plan it."""


class ExecutionError(VbsError):
    """A plan failed while running on the device."""


class OutOfMemoryError(ExecutionError):
    """The device ran out of memory while running a plan."""
