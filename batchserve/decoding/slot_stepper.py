"""The thread that runs a `SlotDecoder`: sequences join free slots, every step advances them all, each step's
new tokens go to the event loop in one `call_soon_threadsafe`.

Per step the host takes the queued joins and cancels, prefills, launches the next step (a graph replay and an
async copy of its tokens), then collects the previous step's tokens (the one wait, GIL released) and hands them
over. So the host's and the loop's work hide behind the GPU's; the price is one step of lag (a sequence that
ended in step N is still in step N+1, held by its done flag). Live slots and their positions are kept on the
host as plain ints (`slot_map.SlotMap`), so choosing a step's shape needs nothing from the device.

Prefill: joins take their slots at once and are prefilled over the following steps, at most
`prefill_step_tokens` prompt tokens a step, in pieces of the decoder's `chunk_tokens`, so a burst or a long prompt
costs running sequences a bounded pause per step. Prefill is shared by lane (`prefill_share.py`).

Background rows (batch lines, `add(..., background=True)`) sit above the foreground rows, so a step over the
foreground prefix leaves them out (they keep their state). While foreground rows are live, `step_share.StepShare`
decides per step whether they go in (with their prefill), keeping foreground steps within `slowdown` x their
time alone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchserve.decoding.prefill_share import (
    LaneCharges,
    Piece,
    PrefillLedger,
    Prompt,
    TokenRate,
    first_lane,
    limited_lanes,
    plan_prefill,
)
from batchserve.decoding.shares import INTERACTIVE, SPARE, Lane
from batchserve.decoding.slot_decoder import SlotDecoder, LaunchedStep
from batchserve.decoding.slot_map import Filling, Join, Live, SlotMap
from batchserve.decoding.step_share import Booking, StepShare
from batchserve.decoding.stepper import KvCapacity, Deliver, SamplingParams, TokenUpdate

log = logging.getLogger("batchserve.generation")

JOIN_DELAY_STEPS = 4  # a waiting sequence joins within this many steps even when few others wait with it


def join_now(waiting: int, room: int, live: int, waited_steps: int, join_batch: int, delay_steps: int) -> int:
    """How many waiting sequences to prefill before the next step. A prefill pauses the running sequences and a
    few joins cost about what many do, so while others run, joins gather until `join_batch` wait or the oldest
    has waited `delay_steps` steps; with nothing running they start at once."""
    n = min(waiting, room)
    if n == 0 or live == 0 or n >= join_batch or waited_steps >= delay_steps:
        return n
    return 0


@dataclass(frozen=True)
class Pending:
    """A launched step not yet collected: who was in it (and at which slot), and how the ledger booked it."""

    ticket: LaunchedStep
    members: list[tuple[Live, int]]
    rows: int  # its rows as the ledger counts them (padded up to the bucket the decoder runs)
    booking: Booking | None


class SlotStepper:
    """Continuous batching over a `SlotDecoder`'s slots, on a thread of its own."""

    def __init__(
        self,
        decoder: SlotDecoder,
        step_s: float,
        join_batch: int = 0,
        prefill_step_tokens: int = 0,
        slowdown: float = 1.25,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`join_batch`: see join_now; `prefill_step_tokens`: prompt tokens prefilled between two steps at most
        (default: the decoder's prefill_tokens); `slowdown`: how much background rows may lengthen the foreground
        rows' steps (`step_share.StepShare`)."""
        self.decoder = decoder
        self.prefill_step_tokens = prefill_step_tokens or decoder.prefill_tokens
        self.prefills = 0  # prefill forwards run
        self.pieces = 0  # prompt pieces prefilled (more than the sequences when prompts were chunked)
        self.step_s = step_s
        self.join_batch = join_batch or max(1, decoder.slots // 16)
        self.steps = 0  # steps launched
        self.moved = 0  # sequences moved to lower slots
        self.share = StepShare(slowdown, seed=decoder.step_times)
        self.row_growth = decoder.row_growth  # both measured by the decoder's warm-up, which runs first
        self.slot_map = SlotMap(decoder, self.share)  # who sits in which slot (stepper thread only)
        self._clock = clock
        self.charges = LaneCharges()  # prompt tokens prefilled by lane (`prefill_share`)
        self.prefill_ledger = PrefillLedger()  # interactive prefill beside another tenant's decoding rows
        self.prefill_rate = TokenRate()  # seconds per prompt token, learned
        self.batch_prefill_skipped = 0  # steps in a row batch prefill waited beside interactive rows, and got none
        self.full_steps = 0  # steps with foreground rows live and background rows in them
        self.interactive_only_steps = 0  # steps of the foreground rows alone while background work waited
        self.unseparated_steps = 0  # of the full steps, those the ledger would have run without background rows
        self._background_prefilled = False  # background prefill ran before the step being launched
        self.resumable = True  # a cancelled sequence added again with `resumed` recomputes its K/V (preemption)
        self.shares_steps = True  # background rows sit out steps as the ledger says (`step_share`)
        # a slot is one block of a whole sequence's tokens
        self.capacity = KvCapacity(decoder.slots, decoder.slot_tokens, decoder.slots, decoder.slot_tokens)
        self.description = (
            f"slots: {decoder.slots} x {decoder.slot_tokens} tokens, "
            f"{'CUDA graphs' if decoder.use_graphs else 'eager'} on {decoder.device}"
        )
        self._cond = threading.Condition()
        self._joins: list[Join] = []
        self._cancels: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Deliver | None = None
        self.failure: BaseException | None = None

    # -- the loop's side ----------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self._loop, self._deliver = loop, deliver
        self._thread = threading.Thread(target=self._run, name="batchserve-generation", daemon=True)
        self._thread.start()

    def add(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams, background: bool = False, tenant: str = ""
    ) -> None:
        with self._cond:
            self._joins.append(Join(seq_id, prompt_ids, params, self.steps, background, tenant))
            self._cond.notify()

    def cancel(self, seq_id: str) -> None:
        with self._cond:
            self._cancels.append(seq_id)
            self._cond.notify()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def kv_usage(self) -> float:
        return (len(self.slot_map.live) + len(self.slot_map.filling)) / self.decoder.slots

    def step_mix(self) -> dict[str, float]:
        """Steps launched and, beside background work, how many included it or left it out."""
        return {
            "steps": self.steps,
            "full": self.full_steps,
            "interactive_only": self.interactive_only_steps,
            "unseparated": self.unseparated_steps,
            "forced": self.share.forced_steps,
        }

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the stepper thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        pending: Pending | None = None  # the launched step not yet collected
        seats = self.slot_map
        try:
            while True:
                with self._cond:
                    while not (
                        self._joins or self._cancels or seats.live or seats.filling or pending or self._stopping
                    ):
                        self._cond.wait()
                    if self._stopping:
                        return
                    cancels, self._cancels = self._cancels, []
                    if cancels:  # a sequence cancelled before it joined never starts
                        gone = set(cancels)
                        self._joins = [j for j in self._joins if j.seq_id not in gone]
                    room = len(seats.free) + sum(1 for c in cancels if c in seats.slot_of)
                    take = join_now(
                        len(self._joins),
                        room,
                        max(0, len(seats.live) - len(cancels)),
                        self.steps - self._joins[0].step if self._joins else 0,
                        self.join_batch,
                        JOIN_DELAY_STEPS,
                    )
                    joins, self._joins = self._joins[:take], self._joins[take:]
                updates, pending = self._turn(cancels, joins, pending)
                if updates:
                    self._send(updates)
        except BaseException as exc:  # reported to every sequence; is_running() turns False
            log.exception("the generation stepper stopped")
            self.failure = exc
            with self._cond:
                waiting, self._joins = [j.seq_id for j in self._joins], []
            error = f"the generation stepper stopped: {type(exc).__name__}: {exc}"
            filling = [f.join.seq_id for f in seats.filling if not f.over]
            ids = [*(live.seq_id for live in seats.live.values()), *filling, *waiting]
            self._send([TokenUpdate(seq_id, [], True, error) for seq_id in ids])

    def _turn(
        self, cancels: list[str], joins: list[Join], pending: Pending | None
    ) -> tuple[list[TokenUpdate], Pending | None]:
        """One turn of the thread; returns the updates to hand over and the step now in flight."""
        updates: list[TokenUpdate] = []
        seats = self.slot_map
        seats.drop(cancels)
        if joins:
            seats.seat(joins)
        include = self._include()  # decided before the prefill: background prefill goes with its rows
        if seats.filling:
            updates += self._prefill(include)
        self.moved += seats.compact()
        launched = self._launch(include) if seats.live else None
        if pending is not None:
            updates += self._collect(pending)
        return updates, launched

    def _send(self, updates: list[TokenUpdate]) -> None:
        assert self._loop is not None and self._deliver is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, updates)
        except RuntimeError:  # the loop has closed: nobody is waiting
            pass

    def _prefill(self, background: bool = True) -> list[TokenUpdate]:
        """This step's share of the prefill (`prefill_share.plan_prefill`), in forwards one prefill holds: first
        and later pieces apart, shortest first. `background` False: the background joins wait."""
        seats = self.slot_map
        lanes = {f.join.lane for f in seats.filling}
        self.charges.present(lanes)
        decoding = {live.tenant for live in seats.live.values() if not live.background}
        filling = [f for f in seats.filling if background or not f.join.background]
        prompts = [Prompt(f.join.lane, f.done, len(f.join.prompt_ids)) for f in filling]
        # the background prompts left out change nothing here: the first lane is an interactive one
        limited = limited_lanes(lanes, decoding, first_lane(prompts, self.charges.tokens, self.decoder.chunk_tokens))
        pools: dict[int, int] = {}
        if any(lane[0] == INTERACTIVE for lane in limited):
            ledger = self.prefill_ledger
            pools[INTERACTIVE] = self.prefill_rate.afford(ledger.credit, ledger.skipped)
        if background and any(lane[0] == SPARE for lane in limited):
            room = self.share.prefill_room(*self._rows(seats.front()))
            pools[SPARE] = self.prefill_rate.afford(room, self.batch_prefill_skipped)
        pieces = plan_prefill(
            prompts, self.prefill_step_tokens, self.decoder.chunk_tokens, self.charges.tokens, pools, limited
        )
        went = {filling[p.index].join.lane[0] for p in pieces if filling[p.index].join.lane in limited}
        waited = {lane[0] for lane in limited}
        self.prefill_ledger.skipped = self.prefill_ledger.skipped + 1 if INTERACTIVE in waited - went else 0
        self.batch_prefill_skipped = self.batch_prefill_skipped + 1 if SPARE in waited - went else 0
        updates: list[TokenUpdate] = []
        for continued in (False, True):
            groups: list[list[Piece]] = []
            for piece in sorted((p for p in pieces if (p.start > 0) == continued), key=lambda p: p.length):
                if not groups or not self.decoder.prefill_fits(len(groups[-1]) + 1, piece.length, continued):
                    groups.append([])
                groups[-1].append(piece)
            for group in groups:
                updates += self._prefill_group(filling, group, limited)
        seats.filling = [f for f in seats.filling if not f.over]
        return updates

    def _rows(self, front: list[int]) -> tuple[int, int]:
        """The rows (padded) of a step over the foreground rows (`front`) alone, and over every live row."""
        shape = self.decoder.shape
        return shape(max(front, default=-1) + 1, 1)[0], shape(max(self.slot_map.live, default=-1) + 1, 1)[0]

    def _prefill_group(self, filling: list[Filling], group: list[Piece], limited: set[Lane]) -> list[TokenUpdate]:
        """One prefill forward of these pieces (indexes into `filling`), charged to their lanes; `limited` lanes'
        time goes to their ledger (interactive: the prefill ledger; background: the slowdown ledger)."""
        fills = [filling[p.index] for p in group]
        slots = [f.slot for f in fills]
        began = self._clock()
        try:
            first, done = self.decoder.prefill(
                slots,
                [f.join.prompt_ids[p.start : p.start + p.length] for f, p in zip(fills, group)],
                [f.join.params for f in fills],
                [p.start for p in group],
                [p.last for p in group],
            )
        except Exception as exc:  # these sequences fail, the running ones go on
            log.exception("prefill of %d sequences failed", len(group))
            self.decoder.release(slots)
            for f in fills:
                self.slot_map.unseat(f)
            return [TokenUpdate(f.join.seq_id, [], True, f"{type(exc).__name__}: {exc}") for f in fills]
        seconds = self._clock() - began
        self.prefills += 1
        self.pieces += len(group)
        tokens = sum(p.length for p in group)
        self.prefill_rate.measured(seconds, tokens)
        self._background_prefilled |= any(f.join.background for f in fills)
        priced = {INTERACTIVE: 0, SPARE: 0}
        for f, p in zip(fills, group):
            self.charges.charge(f.join.lane, p.length)
            if f.join.lane in limited:
                priced[f.join.lane[0]] += p.length
        if priced[SPARE]:
            self.share.charge(seconds * priced[SPARE] / tokens)
        if priced[INTERACTIVE]:
            self.prefill_ledger.spend(seconds * priced[INTERACTIVE] / tokens)
        updates = []
        for f, piece, token, ended in zip(fills, group, first, done):
            f.done += piece.length
            if not piece.last:
                continue
            f.over = True
            self.slot_map.live[f.slot] = Live(
                f.join.seq_id,
                f.slot,
                len(f.join.prompt_ids),
                not f.join.params.greedy,
                background=f.join.background,
                tenant=f.join.tenant,
            )
            updates.append(TokenUpdate(f.join.seq_id, [token], ended))
            if ended:
                self.slot_map.end(f.slot)
        return updates

    def _include(self) -> bool:
        """Whether the next step covers the background rows: always, unless foreground rows are live beside them;
        then as `step_share.StepShare` says."""
        seats = self.slot_map
        front = seats.front()
        if not front or not (len(front) < len(seats.live) or any(f.join.background for f in seats.filling)):
            return True
        return self.share.include(*self._rows(front))

    def _launch(self, include: bool = True) -> Pending:
        """Start a step over the live slots (`include` False: the foreground prefix only); returns who is in it."""
        seats = self.slot_map
        front = seats.front()
        limit = self.decoder.shape(max(front) + 1, 1)[0] if front and not include else self.decoder.slots
        members = [(live, slot) for slot, live in seats.live.items() if slot < limit]
        rows = max(slot for _, slot in members) + 1
        span = max(live.pos for live, _ in members) + 1
        ticket = self.decoder.launch(rows, span, any(live.sampling for live, _ in members))
        self.steps += 1
        for live, _ in members:
            live.pos += 1
        counted = self.decoder.shape(rows, 1)[0]
        booking = None
        waiting = len(front) < len(seats.live) or self._background_prefilled
        if front and (waiting or any(f.join.background for f in seats.filling)):
            ran = self._background_prefilled or any(live.background for live, _ in members)
            booking = self.share.book(counted, self.decoder.shape(max(front) + 1, 1)[0], ran)
            if any(live.background for live, _ in members):
                self.full_steps += 1
                self.unseparated_steps += not include
            else:
                self.interactive_only_steps += 1
        self._background_prefilled = False
        return Pending(ticket, members, counted, booking)

    def _collect(self, pending: Pending) -> list[TokenUpdate]:
        """The step's token for each live member; members the device marked done leave."""
        tokens, done = self.decoder.collect(pending.ticket)
        seconds = self.decoder.step_seconds(pending.ticket)
        self.share.measured(pending.rows, seconds, pending.booking)
        seats = self.slot_map
        decoding = {live.tenant for live in seats.live.values() if not live.background}
        if any(not f.join.background and decoding - {f.join.tenant} for f in seats.filling):
            self.prefill_ledger.earn(seconds)  # another tenant's prefill waited beside these rows
        updates = []
        for live, slot in pending.members:
            if live.ended:
                continue
            updates.append(TokenUpdate(live.seq_id, [tokens[slot]], done[slot]))
            if done[slot]:
                seats.end(live.slot)
        return updates
