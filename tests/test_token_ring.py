"""serving.token_ring on the CPU: where each row's token lands ([position % R, row]), one read per landing, and a
launch that would overwrite an unread landing reading it first (so no order of launches and reads loses a token)."""
import torch

from serving.token_ring import RING_ROWS, TokenRing


def store(ring: TokenRing, positions: list[int], tokens: list[int]) -> None:
    """What a decode step's argmax does to the ring (reference.advance_decode_inputs)."""
    for r, (p, t) in enumerate(zip(positions, tokens)):
        ring.slots[p % RING_ROWS, r] = t


def launch(ring: TokenRing, positions: list[int], tokens: list[int]):
    ring.before_launch(positions)
    store(ring, positions, tokens)
    return ring.land(positions)


def test_a_landing_reads_each_row_at_its_position():
    ring = TokenRing(4, torch.device("cpu"))
    landed = launch(ring, [5, 0, RING_ROWS + 2], [11, 12, 13])
    assert landed.read() == [11, 12, 13]
    store(ring, [5, 0, RING_ROWS + 2], [0, 0, 0])
    assert landed.read() == [11, 12, 13] and ring.num_read == 1  # read once, kept


def test_steps_in_flight_keep_their_tokens():
    # decode ahead: step n + 1 is launched before step n is read; neither overwrites the other
    ring = TokenRing(2, torch.device("cpu"))
    first = launch(ring, [7, 3], [1, 2])
    second = launch(ring, [8, 4], [3, 4])
    assert first.read() == [1, 2] and second.read() == [3, 4]


def test_a_launch_over_an_unread_landing_reads_it_first():
    # R steps of one row unread: the R-th launch lands on the first's cell, which is read before it is overwritten
    ring = TokenRing(1, torch.device("cpu"))
    landings = [launch(ring, [10 + i], [100 + i]) for i in range(RING_ROWS + 1)]
    assert ring.num_read == 1
    assert [landed.read() for landed in landings] == [[100 + i] for i in range(RING_ROWS + 1)]
    # another sequence in the same batch row at a position of the same cell: the same
    ring2 = TokenRing(1, torch.device("cpu"))
    a = launch(ring2, [3], [30])
    b = launch(ring2, [3 + 2 * RING_ROWS], [31])
    assert a.read() == [30] and b.read() == [31]
