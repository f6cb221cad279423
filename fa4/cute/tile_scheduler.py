"""Tile scheduling of the CuTe-DSL attention forward: which (m_block, head group, batch) tiles a CTA computes.

A tile is one Q tile (tile_m packed rows) of one head group of one sequence; there are
num_m_blocks x num_head_groups x batch of them (num_m_blocks from the longest sequence: with varlen, tiles past a
shorter sequence's end are skipped by the kernel).

- Non-persistent (`persistent=False`): one CTA per tile, grid (num_m_blocks, num_head_groups, batch).
  Neighbouring CTAs share a head, so their K/V reads hit L2. For causal attention the m order is reversed: the
  CTAs that start first take the last (longest) Q tiles and the short ones fill the tail of the wave.
- Persistent (`persistent=True`): grid = min(number of SMs, tiles); CTA c takes the tiles c, c + grid,
  c + 2 grid... of a linear order (static strided: no atomics, so the producer warp and the consumer warpgroups
  of a CTA walk the same list without talking). The linear order puts m_block outermost, reversed when causal
  (longest tiles first: all heads and sequences of the last Q tile, then the one before...), so each round of
  `grid` tiles holds tiles of about one length and the short ones end the kernel.

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


@cute.jit
def tile_coords(t: Int32, num_m_blocks: Int32, num_head_groups: Int32, batch: Int32,
                longest_first: cutlass.Constexpr, persistent: cutlass.Constexpr):
    """-> (m_block, head_group, batch) of linear tile t (non-persistent: of this CTA)."""
    m_block, head_group, b = Int32(0), Int32(0), Int32(0)
    if cutlass.const_expr(persistent):
        per_m = num_head_groups * batch
        m_block = t // per_m
        rest = t - m_block * per_m
        b = rest // num_head_groups
        head_group = rest - b * num_head_groups
    else:
        bidx, bidy, bidz = cute.arch.block_idx()
        m_block, head_group, b = Int32(bidx), Int32(bidy), Int32(bidz)
    if cutlass.const_expr(longest_first):
        m_block = num_m_blocks - 1 - m_block
    return m_block, head_group, b
