"""How a job's ``world_size × workers`` slots share each sub-stream's endless sequence of
batches (:class:`Deal`), and where any batch of that sequence lies (:func:`locate`): its
epoch, the unit it is cut from and its place in that unit's cut, in O(1) from the index.

The sequence runs epoch after epoch, each epoch its units (``melcache/loader/schedule.py``)
in an order drawn for it; a fresh job deals each epoch whole, each slot a block of it, and a
job resumed from one of another size or mix first reads what that job left unread.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools

from melcache.batch_plans import SUBSTREAM_ORDER, make_rng
from melcache.loader.schedule import SubStream


def chunk_size(sub: SubStream, num_slots: int) -> int:
    """Batches a slot takes in a row: about its share of an epoch, at least one."""
    return max(1, sub.per_epoch // num_slots)


def global_batch(sub: SubStream, *, slot: int, num_slots: int, taken: int) -> int:
    """Number, in the sub-stream's endless sequence, of slot ``slot``'s batch after ``taken``:
    slots take chunks in turn, so the slots' batches are disjoint and cover the sequence."""
    size = chunk_size(sub, num_slots)
    return (slot + (taken // size) * num_slots) * size + taken % size


@dataclasses.dataclass(frozen=True)
class Deal:
    """How the slots of a job share one sub-stream's endless sequence of batches.

    A job resumed from a job of another size or mix (``melcache/loader/resume/elsewhere.py``) first
    reads ``leftover``, the batches before ``frontier`` (an epoch boundary) that the old job
    left unread (sorted, disjoint ``[start, stop)`` runs), then deals the sequence from
    ``frontier`` on as a fresh job of its size deals it from 0.

    ``by_epoch`` (batch plan 4 on): the job's places ``taken × slots + slot`` are cut into the
    leftover, then one epoch after another, and each slot's places in one of them are a
    block of it, the blocks in slot order. A slot's batches of an epoch are neighbours, in
    few units. Where every slot takes one batch a step (ranks of one worker each, one cache),
    places are read in order, so the job reads each epoch whole before any batch of the
    next (ranks in order within the step they share), whatever its size; a rank's workers
    serve its steps in turn, so there a turn of them reads the places of one ``taken``
    (epochs meet within a turn), and they drift apart by the buckets they draw.

    Otherwise (plans 1–3) a fresh job deals the whole sequence in chunks
    (:func:`global_batch`), whose turns run across epoch ends: where an epoch is not a whole
    number of turns, some slots read the next epoch's first chunk while one finishes this
    one's last. There each slot reads a near-equal run of the leftover (the larger runs
    first); where chunks are of one (an epoch has fewer than two batches per slot), the
    slots take the leftover and then the sequence one batch each in turn.
    """

    frontier: int = 0
    leftover: tuple[tuple[int, int], ...] = ()
    by_epoch: bool = False

    @functools.cached_property
    def ends(self) -> tuple[int, ...]:
        """Running count of leftover batches at the end of each run."""
        return tuple(itertools.accumulate(stop - start for start, stop in self.leftover))

    @property
    def leftover_size(self) -> int:
        """Batches in the leftover."""
        return self.ends[-1] if self.ends else 0

    def share(self, slot: int, num_slots: int) -> tuple[int, int]:
        """Slot ``slot``'s part ``[first, end)`` of the leftover, counted in leftover batches:
        near-equal and the larger parts first, so the slots leave the leftover together."""
        total = self.leftover_size
        return -(-slot * total // num_slots), -(-(slot + 1) * total // num_slots)

    def number(self, sub: SubStream, *, slot: int, num_slots: int, taken: int) -> int:
        """Number, in the sub-stream's sequence, of slot ``slot``'s batch after ``taken``."""
        if self.by_epoch:
            start, first, _ = self.block(sub, slot=slot, num_slots=num_slots, taken=taken)
            return (
                self.leftover_batch(first)
                if start < self.leftover_size
                else self.fresh(start) + first
            )
        if chunk_size(sub, num_slots) == 1:
            place, total = taken * num_slots + slot, self.leftover_size
            return self.leftover_batch(place) if place < total else self.frontier + place - total
        first, end = self.share(slot, num_slots)
        if taken < end - first:
            return self.leftover_batch(first + taken)
        fresh = global_batch(sub, slot=slot, num_slots=num_slots, taken=taken - (end - first))
        return self.frontier + fresh

    def block(
        self, sub: SubStream, *, slot: int, num_slots: int, taken: int
    ) -> tuple[int, int, int]:
        """``by_epoch``: where slot ``slot``'s batch after ``taken`` lies. The job's place of
        it (rank order) falls in a part, the leftover or an epoch after it, that starts at
        place ``start``; the batch is ``first`` of that part's (a leftover place, or batches
        from the epoch's first), and the slot's block in the part ends before ``end``."""
        total, place = self.leftover_size, taken * num_slots + slot
        if place < total:
            start, stop = 0, total
        else:
            start = place - (place - total) % sub.per_epoch
            stop = start + sub.per_epoch
        head = _below_slot(stop, slot, num_slots) - _below_slot(start, slot, num_slots)
        mine = _of_slot(start, slot, num_slots)
        return start, head + taken - mine, head + _of_slot(stop, slot, num_slots) - mine

    def fresh(self, start: int) -> int:
        """``by_epoch``: the sequence number of the first batch of the epoch after the
        leftover whose first place (rank order) is ``start``."""
        return self.frontier + start - self.leftover_size

    def read_by_job(self, num_slots: int, taken: float) -> float:
        """Batches of the sequence a job of ``num_slots`` slots has read when each has taken
        ``taken``: what the old job read before ``frontier``, then the slots' own."""
        return self.frontier - self.leftover_size + num_slots * taken

    def leftover_batch(self, place: int) -> int:
        """The sequence number of the leftover's ``place``-th batch."""
        run = bisect.bisect_right(self.ends, place)
        return self.leftover[run][0] + place - (self.ends[run - 1] if run else 0)

    def leftover_runs(self, first: int, end: int) -> list[tuple[int, int]]:
        """The sequence numbers of leftover places ``first..end-1``, as runs."""
        runs = []
        while first < end:
            run = bisect.bisect_right(self.ends, first)
            start = self.leftover_batch(first)
            length = min(end, self.ends[run]) - first
            runs.append((start, start + length))
            first += length
        return runs


EPOCH_DEAL_PLAN = 4  # the first batch plan whose deals are by_epoch (before: chunks in turn)


def fresh_deal(plan: int) -> Deal:
    """A fresh job's deal of a sub-stream under batch plan ``plan``."""
    return Deal(by_epoch=plan >= EPOCH_DEAL_PLAN)


def _of_slot(end: int, slot: int, num_slots: int) -> int:
    """How many of the places ``0..end-1`` in rank order (``taken × num_slots + slot``) are
    slot ``slot``'s."""
    return max(0, -(-(end - slot) // num_slots))


def _below_slot(end: int, slot: int, num_slots: int) -> int:
    """How many of the places ``0..end-1`` in rank order are those of slots below ``slot``."""
    return end // num_slots * slot + min(end % num_slots, slot)


def visit_run(
    sub: SubStream, deal: Deal, *, seed: int, slot: int, num_slots: int, taken: int, limit: int
) -> int:
    """How many of slot ``slot``'s batches from its ``taken``-th on are of one visit of one
    unit (the same epoch and place), counted up to ``limit``: the share of the unit the
    slot's read is for."""

    def visit(t: int) -> tuple[int, int]:
        number = deal.number(sub, slot=slot, num_slots=num_slots, taken=t)
        return locate(sub, seed=seed, number=number)[:2]

    first, run = visit(taken), 1
    while run < limit and visit(taken + run) == first:
        run += 1
    return run


def locate(sub: SubStream, *, seed: int, number: int) -> tuple[int, int, int]:
    """``(epoch, place in sub.units, batch of that unit's cut)`` of batch ``number``."""
    epoch, offset = divmod(number, sub.per_epoch)
    order, ends = _epoch_layout(sub, seed, epoch)
    pos = bisect.bisect_right(ends, offset)
    return epoch, order[pos], offset - (ends[pos - 1] if pos else 0)


@functools.lru_cache(maxsize=64)
def _epoch_layout(sub: SubStream, seed: int, epoch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The epoch's order of ``sub.units`` places, and the running batch count at the end
    of each."""
    parts = (epoch, sub.part) if sub.part else (epoch,)  # part 0: the unsplit bucket's order
    rng = make_rng(seed, SUBSTREAM_ORDER, sub.source, sub.bucket + 1, *parts)
    order = tuple(rng.permutation(len(sub.units)).tolist())
    return order, tuple(itertools.accumulate(sub.batches[i] for i in order))
