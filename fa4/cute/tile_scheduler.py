"""Tile scheduling of the CuTe-DSL attention forward: which (m_block, head group, batch) a CTA computes.

`StaticTileScheduler` (stage 1): one CTA per tile, grid (num_m_blocks, num_head_groups, batch). Neighbouring
CTAs share a head, so their K/V reads hit L2. For causal attention the m order is reversed: the CTAs that
start first take the last (longest) Q tiles and the short ones fill the tail of the wave.
A persistent scheduler (stage 2) will keep the same `get_work` contract over a loop of tiles.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


def grid_shape(num_m_blocks: int, num_head_groups: int, batch: int) -> tuple:
    return (num_m_blocks, num_head_groups, batch)


class StaticTileScheduler:
    def __init__(self, num_m_blocks: Int32, longest_first: bool):
        self.num_m_blocks = num_m_blocks
        self.longest_first = longest_first

    @cute.jit
    def get_work(self):
        """-> (m_block, head_group, batch) of this CTA."""
        bidx, bidy, bidz = cute.arch.block_idx()
        m_block = Int32(bidx)
        if cutlass.const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_block
        return m_block, Int32(bidy), Int32(bidz)
