"""Tile scheduling of the CuTe-DSL attention forward: which (m_block, head group, batch) tiles a CTA computes.

A tile is one Q tile (tile_m packed rows) of one head group of one sequence; there are
num_m_blocks x num_head_groups x batch of them (num_m_blocks from the longest sequence: with varlen, tiles past a
shorter sequence's end are skipped by the kernel).

- Non-persistent (`persistent=False`): one CTA per tile, grid (num_m_blocks, num_head_groups, batch).
  Neighbouring CTAs share a head, so their K/V reads hit L2. For causal attention the m order is reversed: the
  CTAs that start first take the last (longest) Q tiles and the short ones fill the tail of the wave.
- Persistent (`persistent=True`): grid = min(number of SMs, tiles); CTA c takes the tiles c, c + grid,
  c + 2 grid... of a linear order (static strided: no atomics, so the producer warp and the consumer warpgroups
  of a CTA walk the same list without talking). The linear order (`persistent_order`) runs through sections of
  `pairs_per_section` (head group, sequence) pairs: a section's tiles come with m_block outer (reversed when
  causal: longest first) and the pairs inner, so the CTAs at work at once read the K/V of about one section,
  which the host sizes to fit L2 (fa4/cute/entry.py). Why sections: with m_block outermost over all pairs, the
  132 CTAs at work read 132 different heads' K/V (528 MB at B4 S8k H32 d128) and the loop was DRAM-bound
  (profiles/FINDINGS.md, CuTe forward).

Both walk the same loop: t = first_tile(); while t < num_tiles(): tile_coords(t) -> (m_block, head_group,
batch); t = next_tile(t).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


def grid_shape(num_m_blocks: int, num_head_groups: int, batch: int, persistent: bool = False,
               num_sms: int = 132) -> tuple:
    if persistent:
        return (max(1, min(num_sms, num_m_blocks * num_head_groups * batch)), 1, 1)
    return (num_m_blocks, num_head_groups, batch)


@cute.jit
def first_tile(persistent: cutlass.Constexpr) -> Int32:
    t = Int32(0)
    if cutlass.const_expr(persistent):
        bidx, _, _ = cute.arch.block_idx()
        t = Int32(bidx)
    return t


@cute.jit
def num_tiles(num_m_blocks: Int32, num_head_groups: Int32, batch: Int32, persistent: cutlass.Constexpr) -> Int32:
    """How many linear tiles this CTA's loop walks (persistent: all; else its single one)."""
    total = Int32(1)
    if cutlass.const_expr(persistent):
        total = num_m_blocks * num_head_groups * batch
    return total


@cute.jit
def next_tile(t: Int32, persistent: cutlass.Constexpr) -> Int32:
    step = Int32(1)
    if cutlass.const_expr(persistent):
        gdimx, _, _ = cute.arch.grid_dim()
        step = Int32(gdimx)
    return t + step


def persistent_order(t, num_m_blocks, num_head_groups, batch, pairs_per_section, longest_first: bool, minimum=min):
    """(m_block, head_group, batch) of linear tile t of the persistent loop. Plain arithmetic: the kernel traces it
    on Int32 values (minimum = cutlass.min), the tests run it on ints."""
    pairs = num_head_groups * batch
    section = t // (pairs_per_section * num_m_blocks)
    within = t - section * pairs_per_section * num_m_blocks
    width = minimum(pairs_per_section, pairs - section * pairs_per_section)  # the last section may be narrower
    m_index = within // width
    pair = section * pairs_per_section + within - m_index * width
    b = pair // num_head_groups
    m_block = num_m_blocks - 1 - m_index if longest_first else m_index
    return m_block, pair - b * num_head_groups, b


@cute.jit
def tile_coords(t: Int32, num_m_blocks: Int32, num_head_groups: Int32, batch: Int32, pairs_per_section: Int32,
                longest_first: cutlass.Constexpr, persistent: cutlass.Constexpr):
    """-> (m_block, head_group, batch) of linear tile t (non-persistent: of this CTA)."""
    m_block, head_group, b = Int32(0), Int32(0), Int32(0)
    if cutlass.const_expr(persistent):
        m_block, head_group, b = persistent_order(t, num_m_blocks, num_head_groups, batch, pairs_per_section,
                                                  longest_first, cutlass.min)
    else:
        bidx, bidy, bidz = cute.arch.block_idx()
        m_block, head_group, b = Int32(bidx), Int32(bidy), Int32(bidz)
        if cutlass.const_expr(longest_first):
            m_block = num_m_blocks - 1 - m_block
    return m_block, head_group, b
