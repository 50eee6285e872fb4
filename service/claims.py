"""One request's claims, taken in order and given back in reverse, for HTTP and gRPC alike.

An inference request pins its model (``service.residency``: loaded first if it is not), then,
under a memory limit, takes a place in the device memory owner's ledger before its body is read
(``service.admission``), tells the ledger its exact hold once it is decoded, and submits its
samples to the model's batcher. Each claim is given back exactly once, the ticket before the
pin, however the request ends: one owner, so no edge can take a claim and forget it.

The same object is the one thing a request carries between steps: what the metrics count it
by (its endpoint, its model, what receiving its body took, its outcome). The metrics
middleware makes one per HTTP request (``request.state.vbs``); a gRPC call makes its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from service.admission import estimate_hold

if TYPE_CHECKING:
    from service.batch_stage import Outcome
    from service.entry import ModelEntry
    from service.registry import Registry
    from service.residency import Use
    from workers.ledger import Ticket

NO_MODEL = "-"  # the model label of a request that named none we know


def _bytes_out(output_shape: tuple[int, ...], samples: int) -> int:
    """What a request's outputs hold as float32, and their encoding beside them."""
    return 3 * int(np.prod(output_shape, dtype=np.int64)) * 4 * samples


@dataclasses.dataclass(eq=False)
class Claims:
    """What one request names, holds and ran (see the module doc)."""

    endpoint: str = "other"
    model: str = NO_MODEL
    receive_s: float = 0.0              # receiving the body: the network's time, not ours
    outcome: Outcome | None = None      # what ran it, once answered
    _registry: Registry | None = dataclasses.field(default=None, repr=False)
    _use: Use | None = dataclasses.field(default=None, repr=False)
    _ticket: Ticket | None = dataclasses.field(default=None, repr=False)

    @property
    def pinned(self) -> bool:
        return self._use is not None

    # ------------------------------------------------------------------ taken in order

    async def pin(self, registry: Registry, entry: ModelEntry) -> None:
        """``entry`` pinned for this request, loaded: at once, or after waiting for its load
        up to ``request_timeout_s`` (``Residency.use``: 503, or 413 when it never fits)."""
        if self._use is not None:
            return
        self._registry = registry
        self._use = await registry.residency.use(entry, registry.settings.request_timeout_s)

    async def admit(self, registry: Registry, model: str | None, size: int, kind: str,
                    *, received: bool = False) -> None:
        """Under a memory limit, a place for a body of ``size`` bytes of ``kind`` (binary,
        json, image) before it is decoded, waiting in line for room (503 after
        ``line_wait_s``; 413 when it never fits); nothing without a limit. ``received``: the
        body is in memory already (gRPC), so it counts as held at once, not still to come."""
        admission = registry.admission
        if not admission.active:
            return
        self._registry = registry
        self._ticket = await admission.admit(model, estimate_hold(size, kind))
        if received and self._ticket is not None:
            registry.memory.resize(self._ticket, 0)

    def hold(self, held: int, body: bytes | None, x: np.ndarray,
             output_shape: tuple[int, ...]) -> None:
        """The exact bytes the decoded request holds, for the ledger: ``held`` bytes of
        message, its samples ``x`` unless a view of ``body`` (the bytes they came from), its
        outputs and their encoding; kept as long as ``x`` lives (a batch may keep the
        samples after a timeout answered the request)."""
        if self._ticket is None or self._registry is None:
            return
        if not (body and np.may_share_memory(x, np.frombuffer(body, np.uint8))):
            held += x.nbytes
        memory = self._registry.memory
        memory.resize(self._ticket, held + _bytes_out(output_shape, x.shape[0]))
        memory.keep(self._ticket, x)

    async def submit(self, entry: ModelEntry, x: np.ndarray, *, decode_s: float,
                     encode: Callable[[np.ndarray], Any], field: str) -> Outcome:
        """The samples queued on the model's batcher (pinned, loaded); 504 when not answered
        within ``request_timeout_s``, which the waits for the load and for memory count
        toward."""
        assert entry.batcher is not None and self._use is not None
        load_wait_s = self._use.waited_s
        line_wait_s = self._ticket.waited_s if self._ticket is not None else 0.0
        outcome = await entry.batcher.submit(x, decode_s=decode_s, encode=encode, field=field,
                                             waited_s=load_wait_s + line_wait_s)
        if load_wait_s:
            outcome = dataclasses.replace(outcome, timing=dataclasses.replace(
                outcome.timing, load_wait_s=load_wait_s))
        self.outcome = outcome
        return outcome

    # ------------------------------------------------------------------ given back in reverse

    def release(self) -> None:
        """Give back what this request holds under the memory limit, then its pin (each
        once; what was never taken: nothing)."""
        ticket, self._ticket = self._ticket, None
        use, self._use = self._use, None
        if self._registry is None:
            return
        if ticket is not None:
            self._registry.memory.done(ticket)
        if use is not None:
            self._registry.residency.done(use)


def of(state: Any) -> Claims:
    """The claims of the HTTP request whose ``request.state`` is ``state`` (the metrics
    middleware made them; a request that bypassed it gets its own)."""
    claims = getattr(state, "vbs", None)
    if claims is None:
        claims = Claims()
        state.vbs = claims
    return claims


__all__ = ["Claims", "NO_MODEL", "of"]
