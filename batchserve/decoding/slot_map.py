"""Which sequence sits in which of a `SlotDecoder`'s slots: the seating policy of `slot_stepper.SlotStepper`, over
plain ints on the stepper's thread, so that a step covers as few rows as it can.

Rows: a step covers the slots up to the highest live one, padded up to a bucket, and new sequences take the
lowest free slot. When the live sequences would fit a bucket half the size or less, they are moved down first.

Background rows (batch lines) take the highest free slot within the bucket the occupied slots need, and a
foreground sequence left above a background one is moved below it, so a step over the foreground prefix leaves
the background rows out.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from batchserve.decoding.shares import INTERACTIVE, SPARE, Lane
from batchserve.decoding.slot_decoder import SlotDecoder
from batchserve.decoding.step_share import StepShare
from batchserve.decoding.stepper import SamplingParams


@dataclass(eq=False)
class Live:
    """A sequence in a slot, as the host tracks it."""

    seq_id: str
    slot: int  # where it is now (a step launched earlier remembers where it was then)
    pos: int  # the position its next input token is written at (counting the steps launched)
    sampling: bool
    ended: bool = False  # its slot was freed: later steps' tokens for it are ignored
    background: bool = False  # a batch line: kept out of the steps the foreground rows need alone
    tenant: str = ""  # whose rows these are (another tenant's prefill beside them is priced: `prefill_share`)


@dataclass(frozen=True)
class Join:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    step: int  # steps launched when it was added
    background: bool = False
    tenant: str = ""

    @property
    def lane(self) -> Lane:
        return (SPARE if self.background else INTERACTIVE, self.tenant)


@dataclass(eq=False)
class Filling:
    """A sequence in its slot whose prompt is being prefilled, piece by piece."""

    join: Join
    slot: int
    done: int = 0  # prompt tokens whose K/V are in the slot
    over: bool = False  # live now, or failed: leaves the prefilling list
    high: bool = False  # a prompt longer than a piece, in the highest free slot (see `SlotMap.seat`)


class SlotMap:
    """The slots' occupants (`live`, `filling`), the free slots, and the placement over them (`seat`, `compact`)."""

    def __init__(self, decoder: SlotDecoder, share: StepShare) -> None:
        """`share`: the step ledger, which says whether separating foreground and background rows is worth a move."""
        self.decoder = decoder
        self.share = share
        self.live: dict[int, Live] = {}  # slot -> sequence
        self.filling: list[Filling] = []  # sequences in their slots, being prefilled, oldest first
        self.slot_of: dict[str, int] = {}
        self.free = list(range(decoder.slots))  # a heap: the lowest free slot first keeps the step's rows few

    def seat(self, joins: list[Join]) -> None:
        """The joins take their slots, shortest prompts first, and queue for prefill: a foreground join the lowest
        free slot, a background one the highest within the bucket the occupied slots need. A prompt longer than
        one piece takes the highest free slot, so decode steps do not cover its held row while it is prefilled
        over several steps; once live, `compact` and `separate` move it."""
        for join in sorted(joins, key=lambda j: len(j.prompt_ids)):
            high = len(join.prompt_ids) > self.decoder.chunk_tokens
            if not high and not join.background:
                slot = heapq.heappop(self.free)
            else:
                within = self.decoder.slots
                if not high:
                    front = self.front() + [f.slot for f in self.filling if not f.join.background and not f.high]
                    need = max(len(self.slot_of) + 1, max(front, default=-1) + 2)
                    within = self.decoder.shape(min(need, self.decoder.slots), 1)[0]
                slot = max(s for s in self.free if s < within)
                self.free.remove(slot)
                heapq.heapify(self.free)
            self.slot_of[join.seq_id] = slot
            self.filling.append(Filling(join, slot, high=high))

    def front(self) -> list[int]:
        """The slots of the live foreground rows."""
        return [slot for slot, live in self.live.items() if not live.background]

    def drop(self, seq_ids: list[str]) -> None:
        """The cancelled sequences leave their slots (live, or being prefilled), which the decoder releases."""
        slots = [self.slot_of[s] for s in seq_ids if s in self.slot_of]
        self.decoder.release(slots)
        filling = {f.slot: f for f in self.filling}
        for slot in slots:
            if slot in filling:  # cancelled while its prompt was being prefilled
                self.unseat(filling[slot])
            else:
                self.end(slot)
        if slots and filling:
            self.filling = [f for f in self.filling if not f.over]

    def unseat(self, fill: Filling) -> None:
        """A sequence being prefilled leaves its slot; it stays in `filling`, over, until the caller prunes it."""
        fill.over = True
        del self.slot_of[fill.join.seq_id]
        heapq.heappush(self.free, fill.slot)

    def end(self, slot: int) -> None:
        """The live sequence in `slot` leaves it: later steps' tokens for it are ignored."""
        live = self.live.pop(slot)
        live.ended = True
        del self.slot_of[live.seq_id]
        heapq.heappush(self.free, slot)

    def compact(self) -> int:
        """Move live rows down when that at least halves the step's bucket, then `separate`; returns how many moved."""
        if not self.live:
            return 0
        moved = 0
        need = self.decoder.shape(len(self.live), 1)[0]
        if 2 * need <= self.decoder.shape(max(self.live) + 1, 1)[0]:
            targets = sorted(slot for slot in self.free if slot < need)
            movers = sorted(slot for slot in self.live if slot >= need)[: len(targets)]  # prefilling slots take some
            if movers:
                front = [slot for slot in movers if not self.live[slot].background]
                back = [slot for slot in movers if self.live[slot].background]
                targets = targets[: len(front)] + targets[len(targets) - len(back) :]
                moved = self._move(front + back, targets)
        return moved + self.separate()

    def _move(self, sources: list[int], targets: list[int]) -> int:
        """Move live sequences to free slots (K/V and row state); returns how many."""
        span = max(self.live[slot].pos for slot in sources) + 1
        self.decoder.move(sources, targets, span)
        for source, target in zip(sources, targets):
            live = self.live.pop(source)
            live.slot = target
            self.live[target] = live
            self.slot_of[live.seq_id] = target
        self.free = sorted(set(self.free) - set(targets) | set(sources))  # a sorted list is a heap
        return len(sources)

    def separate(self) -> int:
        """While a foreground sequence sits above a background one, move the highest foreground one below (into a
        free slot, else by swapping). Skipped where it gains nothing: the foreground rows alone need the same
        bucket, or rows are nearly free. Returns how many sequences moved."""
        moved = 0
        while True:
            front = self.front()
            back = [slot for slot, live in self.live.items() if live.background]
            if not front or not back or max(front) < min(back):
                return moved
            alone, rows = self.decoder.shape(len(front), 1)[0], self.decoder.shape(max(self.live) + 1, 1)[0]
            if alone >= rows or not self.share.dear(alone, rows):
                return moved
            top, low = max(front), min(back)
            below = [slot for slot in self.free if slot < low]
            if below:
                moved += self._move([top], [min(below)])
                continue
            a, b = self.live.pop(top), self.live.pop(low)
            self.decoder.swap(top, low, max(a.pos, b.pos) + 1)
            a.slot, b.slot = low, top
            self.live[low], self.live[top] = a, b
            self.slot_of[a.seq_id], self.slot_of[b.seq_id] = low, top
            moved += 2
