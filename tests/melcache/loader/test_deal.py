"""How a job's slots share a bucket sub-stream's endless sequence of batches (batch plan 4's
deal by epoch, ``melcache/loader/schedule.py``), and what a job left unread of it
(``melcache/loader/resume/elsewhere.py``), over many random shapes of epoch, job and leftover."""

from __future__ import annotations

import random

from melcache.loader.deal import Deal
from melcache.loader.resume.elsewhere import unread
from melcache.loader.schedule import SubStream


def test_a_deal_by_epoch_reads_each_part_whole_in_rank_order_and_knows_what_is_unread() -> None:
    """Random epochs (1–40 batches), slots (1–20) and leftovers: in rank order (each slot one
    batch a step) the job reads the leftover, then every epoch, each whole before the next;
    a slot's batches of an epoch are neighbours; and after any counts up to 4 steps apart (a
    rank's workers drift), :func:`unread` leaves exactly the batches below its frontier that
    no slot read."""
    rng = random.Random(0)
    for _ in range(500):
        per_epoch, slots = rng.randint(1, 40), rng.randint(1, 20)
        sub = SubStream(0, 0, tuple((i,) for i in range(per_epoch)), (1,) * per_epoch, per_epoch)
        frontier = per_epoch * rng.randint(0, 3)
        picks = sorted(rng.sample(range(frontier), rng.randint(0, frontier)))
        runs: list[list[int]] = []
        for a in picks:  # the leftover: sorted, disjoint runs, touching ones joined
            if runs and runs[-1][1] == a:
                runs[-1][1] = a + 1
            else:
                runs.append([a, a + 1])
        deal = Deal(frontier, tuple((a, b) for a, b in runs), by_epoch=True)
        steps = (len(picks) + 3 * per_epoch) // slots + 6
        read = [[deal.number(sub, slot=s, num_slots=slots, taken=t) for s in range(slots)]
                for t in range(steps)]  # fmt: skip
        flat = [n for row in read for n in row]
        assert sorted(flat[: len(picks)]) == picks
        for e in range((len(flat) - len(picks)) // per_epoch):
            part = flat[len(picks) + e * per_epoch :][:per_epoch]
            assert sorted(part) == list(
                range(frontier + e * per_epoch, frontier + (e + 1) * per_epoch)
            )
        for s in range(slots):
            for e in range(3):
                low = frontier + e * per_epoch
                mine = [row[s] for row in read if low <= row[s] < low + per_epoch]
                assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else True
        base = rng.randint(0, steps - 5)
        taken = [base + rng.randint(0, 4) for _ in range(slots)]
        after = unread(sub, deal, slots, taken)
        last = max((read[taken[s] - 1][s] for s in range(slots) if taken[s]), default=-1)
        assert after.frontier == max(frontier, -(-(last + 1) // per_epoch) * per_epoch)
        seen = {read[t][s] for s in range(slots) for t in range(taken[s])}
        never = set(range(frontier)) - set(picks)  # the old deal had read these already
        left = {n for a, b in after.leftover for n in range(a, b)}
        assert left == set(range(after.frontier)) - seen - never
