"""Sequence slots and KV budget of one node: plain synchronous bookkeeping.

A :class:`Lease` is a sequence id (one KV stream of the engine's context) plus the
KV positions the session may fill. Running out is an ordinary result
(``acquire() -> None``), not an exception. A released slot is not reusable until
the batcher has removed its KV (:meth:`LeaseManager.free`), so two sessions never
share cells.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs


class SlotState(enum.Enum):
    """Life of one sequence slot."""

    FREE = "free"
    LEASED = "leased"
    DRAINING = "draining"  # released by its session, KV not yet removed


@attrs.define(eq=False)
class Lease:
    """One session's claim on a sequence slot and ``tokens`` KV positions."""

    seq_id: int
    tokens: int
    _manager: LeaseManager = attrs.field(repr=False)
    released: bool = False

    def release(self) -> bool:
        """Give the slot back for draining; returns True only the first time (idempotent)."""
        if self.released:
            return False
        self.released = True
        self._manager._drain(self)
        return True


@attrs.frozen
class LeaseStatistics:
    """A snapshot of the node's capacity."""

    slots_total: int
    slots_leased: int
    slots_draining: int
    kv_budget_tokens: int
    kv_reserved_tokens: int
    max_tokens_per_sequence: int
    refused: int

    @property
    def slots_free(self) -> int:
        """Slots a new session could take now."""
        return self.slots_total - self.slots_leased - self.slots_draining


class LeaseManager:
    """Free sequence slots and KV positions; ``acquire`` / ``free`` are synchronous."""

    def __init__(self, n_slots: int, max_tokens_per_sequence: int, kv_budget_tokens: int | None = None) -> None:
        if n_slots <= 0 or max_tokens_per_sequence <= 0:
            raise ValueError("need at least one slot and one token per sequence")
        self.n_slots = n_slots
        self.max_tokens_per_sequence = max_tokens_per_sequence
        self.kv_budget_tokens = kv_budget_tokens if kv_budget_tokens is not None else n_slots * max_tokens_per_sequence
        self._state = [SlotState.FREE] * n_slots
        self._leases: dict[int, Lease] = {}
        self._reserved = 0
        self._refused = 0
        self._leased = 0  # slots in SlotState.LEASED
        # called when a slot can be leased again (the node's tracker link reports it)
        self.on_free: list[Callable[[], None]] = []
        # called when a session is refused for want of a slot or of KV room (the tracker hears at once)
        self.on_refused: list[Callable[[], None]] = []

    def acquire(self, tokens: int) -> Lease | None:
        """A lease for a session that will hold up to ``tokens`` positions, or None if full."""
        if tokens <= 0 or tokens > self.max_tokens_per_sequence:
            self._refused += 1
            return None  # no slot would ever hold it: nothing the tracker's count could change
        if self._reserved + tokens > self.kv_budget_tokens:
            self._refuse()
            return None
        for seq_id, state in enumerate(self._state):
            if state is SlotState.FREE:
                lease = Lease(seq_id, tokens, self)
                self._state[seq_id] = SlotState.LEASED
                self._leased += 1
                self._leases[seq_id] = lease
                self._reserved += tokens
                return lease
        self._refuse()
        return None

    def _refuse(self) -> None:
        self._refused += 1
        for hook in self.on_refused:
            hook()

    @property
    def leased(self) -> int:
        """Slots leased to sessions now (not counting those draining)."""
        return self._leased

    def fits(self, tokens: int) -> bool:
        """Whether a session of ``tokens`` positions could ever be admitted here."""
        return 0 < tokens <= self.max_tokens_per_sequence

    def _drain(self, lease: Lease) -> None:
        if self._leases.get(lease.seq_id) is lease and self._state[lease.seq_id] is SlotState.LEASED:
            self._state[lease.seq_id] = SlotState.DRAINING
            self._leased -= 1

    def free(self, seq_id: int) -> None:
        """The KV of a draining slot is gone: the slot can be leased again. Idempotent."""
        if self._state[seq_id] is SlotState.DRAINING:
            lease = self._leases.pop(seq_id)
            self._reserved -= lease.tokens
            self._state[seq_id] = SlotState.FREE
            for hook in self.on_free:
                hook()

    def state(self, seq_id: int) -> SlotState:
        """The state of one slot."""
        return self._state[seq_id]

    def statistics(self) -> LeaseStatistics:
        """An immutable snapshot."""
        return LeaseStatistics(
            slots_total=self.n_slots,
            slots_leased=self._leased,
            slots_draining=sum(s is SlotState.DRAINING for s in self._state),
            kv_budget_tokens=self.kv_budget_tokens,
            kv_reserved_tokens=self._reserved,
            max_tokens_per_sequence=self.max_tokens_per_sequence,
            refused=self._refused,
        )
