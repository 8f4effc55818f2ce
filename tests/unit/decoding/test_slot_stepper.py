"""Where the slot stepper puts background (batch) rows and which rows a step covers (issue 33), on a stand-in
decoder that records what it is asked: no model. That excluded rows keep their state and resumed ones answer
token for token is tests/integration/decoding/test_background_rows.py, on a model."""

from __future__ import annotations


from batchserve.decoding.slot_decoder import LaunchedStep, bucket_up
from batchserve.decoding.sizing import ROW_BUCKETS
from batchserve.decoding.slot_map import Join, Live
from batchserve.decoding.slot_stepper import SlotStepper
from batchserve.decoding.stepper import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)


class Decoder:
    """What the stepper asks of a SlotDecoder, recorded: moves, swaps and each step's rows."""

    def __init__(self, slots: int, fixed_shapes: bool = False) -> None:
        self.slots, self.slot_tokens, self.prefill_tokens, self.chunk_tokens = slots, 64, 512, 64
        self.fixed_shapes, self.use_graphs, self.device = fixed_shapes, False, "cpu"
        self.step_times: dict[int, float] = {}
        self.row_growth = 0.0
        self.moves: list[tuple[list[int], list[int]]] = []
        self.swaps: list[tuple[int, int]] = []
        self.launched: list[int] = []

    def shape(self, rows: int, span: int) -> tuple[int, int]:
        return (bucket_up(rows, ROW_BUCKETS, self.slots), span) if self.fixed_shapes else (rows, span)

    def move(self, sources: list[int], targets: list[int], span: int) -> None:
        self.moves.append((list(sources), list(targets)))

    def swap(self, a: int, b: int, span: int) -> None:
        self.swaps.append((a, b))

    def launch(self, rows: int, span: int, sampling: bool) -> LaunchedStep:
        self.launched.append(rows)
        return LaunchedStep(rows, 0)

    def release(self, slots: list[int]) -> None:
        pass


def join(stepper: SlotStepper, seq_id: str, background: bool) -> int:
    """`seq_id` joins and its prefill is done (live at position 4); its slot."""
    stepper.slot_map.seat([Join(seq_id, [1, 2, 3, 4], GREEDY, stepper.steps, background)])
    filling = stepper.slot_map.filling.pop()
    stepper.slot_map.live[filling.slot] = Live(seq_id, filling.slot, 4, False, background=background)
    stepper.slot_map.compact()
    return stepper.slot_map.slot_of[seq_id]


def slots_of(stepper: SlotStepper, background: bool) -> list[int]:
    return sorted(slot for slot, live in stepper.slot_map.live.items() if live.background == background)


class Says:
    """A ledger stand-in: the answers to give, and whether it was asked."""

    def __init__(self, *answers: bool) -> None:
        self.answers, self.asked = list(answers), 0

    def __call__(self, foreground_rows: int, rows: int) -> bool:
        self.asked += 1
        return self.answers.pop(0)


def test_background_rows_take_high_slots_and_a_foreground_join_below_them_is_swapped_down() -> None:
    dec = Decoder(8)
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    assert join(stepper, "fg0", False) == 0
    assert join(stepper, "bg0", True) == 1  # the highest free slot within the rows the occupied ones need
    assert join(stepper, "bg1", True) == 2
    assert join(stepper, "fg1", False) == 1  # took slot 3, above both: swapped with the lowest background row
    assert dec.swaps == [(3, 1)]
    assert slots_of(stepper, False) == [0, 1] and slots_of(stepper, True) == [2, 3]
    # fg0 ended: slot 0 is free below every background row
    del stepper.slot_map.live[0], stepper.slot_map.slot_of["fg0"]
    stepper.slot_map.free.append(0)
    stepper.slot_map.compact()
    assert slots_of(stepper, False) == [1]  # nothing above a background row: nothing moves
    assert join(stepper, "fg2", False) == 0


def test_a_background_join_goes_above_the_foreground_rows_even_past_a_hole_below_them() -> None:
    dec = Decoder(8)
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    for i in range(3):
        join(stepper, f"fg{i}", False)  # 0, 1, 2
    del stepper.slot_map.live[1], stepper.slot_map.slot_of["fg1"]  # fg1 ended: a hole at 1
    stepper.slot_map.free.append(1)
    assert join(stepper, "bg", True) == 3
    assert join(stepper, "late", False) == 1 and dec.swaps == [] and dec.moves == []


def test_a_foreground_sequence_above_background_ones_moves_into_a_free_slot_below_them() -> None:
    dec = Decoder(8)
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    for slot, seq_id, background in ((5, "bg", True), (6, "fg", False)):  # as a compaction could leave them
        stepper.slot_map.live[slot] = Live(seq_id, slot, 4, False, background=background)
        stepper.slot_map.slot_of[seq_id] = slot
    stepper.slot_map.free = [0, 1, 2, 3, 4, 7]
    stepper.slot_map.separate()
    assert dec.moves == [([6], [0])] and dec.swaps == []
    assert slots_of(stepper, False) == [0] and slots_of(stepper, True) == [5]
    assert stepper.slot_map.free == [1, 2, 3, 4, 6, 7]


def test_a_step_the_ledger_keeps_background_rows_out_of_covers_the_foreground_prefix_only() -> None:
    dec = Decoder(8)
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    join(stepper, "fg", False)
    join(stepper, "bg0", True)
    join(stepper, "bg1", True)
    says = Says(False, True)
    stepper.share.include = says  # type: ignore[method-assign]
    pending = stepper._launch(stepper._include())
    assert dec.launched == [1] and [live.seq_id for live, _ in pending.members] == ["fg"]
    assert {live.seq_id: live.pos for live in stepper.slot_map.live.values()} == {"fg": 5, "bg0": 4, "bg1": 4}
    pending = stepper._launch(stepper._include())
    assert dec.launched == [1, 3] and len(pending.members) == 3
    assert {live.seq_id: live.pos for live in stepper.slot_map.live.values()} == {"fg": 6, "bg0": 5, "bg1": 5}
    assert stepper.step_mix() == {"steps": 2, "full": 1, "interactive_only": 1, "unseparated": 0, "forced": 0}


def test_with_no_foreground_rows_every_step_runs_every_row_without_asking_the_ledger() -> None:
    dec = Decoder(8)
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    join(stepper, "bg0", True)
    join(stepper, "bg1", True)
    says = Says()
    stepper.share.include = says  # type: ignore[method-assign]
    for _ in range(3):
        stepper._launch(stepper._include())
    assert says.asked == 0 and dec.launched == [2, 2, 2]
    assert stepper.step_mix()["interactive_only"] == 0 and stepper.step_mix()["full"] == 0


def test_on_padded_rows_a_background_row_inside_the_foreground_bucket_takes_part_and_is_counted() -> None:
    dec = Decoder(32, fixed_shapes=True)
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    join(stepper, "fg0", False)
    assert join(stepper, "bg", True) == 7  # the top of the 8-row bucket: a full step covers 8 rows, as before
    stepper.share.include = Says(False, False)  # type: ignore[method-assign]
    stepper._launch(stepper._include())
    assert dec.launched == [1]  # the 1-row bucket leaves the background row out
    join(stepper, "fg1", False)  # now the foreground prefix pads up to 8 rows: the background row is in it
    pending = stepper._launch(stepper._include())
    assert dec.launched[-1] == 8 and {live.seq_id for live, _ in pending.members} == {"fg0", "fg1", "bg"}
    assert stepper.step_mix()["unseparated"] == 1 and stepper.step_mix()["interactive_only"] == 1


def test_rows_nearly_free_or_one_bucket_for_all_move_nothing() -> None:
    dec = Decoder(8)
    dec.step_times = {1: 0.010, 2: 0.0105, 3: 0.011}  # a full step within the slowdown: the ledger takes them all
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    join(stepper, "fg0", False)
    join(stepper, "bg", True)
    assert join(stepper, "fg1", False) == 2 and dec.swaps == [] and dec.moves == []  # left above the batch row
    dec = Decoder(32, fixed_shapes=True)  # the GPU's buckets: 1, 8, 16, 32
    stepper = SlotStepper(dec, step_s=0.01)  # type: ignore[arg-type]
    for i in range(3):
        join(stepper, f"fg{i}", False)  # 0, 1, 2
    assert join(stepper, "bg", True) == 7  # the top of the 8-row bucket
    for i in range(3, 7):
        join(stepper, f"fg{i}", False)  # 3..6
    assert join(stepper, "fg7", False) == 7 and dec.swaps == [(8, 7)]  # 8 foreground rows fill the 8-row bucket
    assert join(stepper, "fg8", False) == 9  # 9 need the 16-row bucket the batch row is in: a swap buys nothing
    assert dec.swaps == [(8, 7)] and dec.moves == []
