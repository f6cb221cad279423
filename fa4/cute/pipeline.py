"""Synchronisation of the CuTe-DSL attention forward: mbarrier pipelines and named barriers.

- Q: a one-stage TMA pipeline. The producer warp loads the CTA's two 64-row Q halves onto one mbarrier
  (tx = both halves); both consumer warpgroups wait on it once.
- K and V: two rings of `kv_stages` buffers each (`cutlass.pipeline.PipelineTmaAsync`): the producer
  acquires an empty slot and arms its full barrier with the tile's bytes; each consumer warp releases a slot
  when its wgmma has read it, so a slot is free again once all 8 consumer warps are done with it.
- Ping-pong (`pingpong_*`): two named barriers order the consumer warpgroups' QK^T issue, so that one
  warpgroup's softmax runs while the other's matmul occupies the tensor cores. Warpgroup 0 goes first;
  each warpgroup waits for its turn, issues, and hands the turn to the other. The other's last hand-back is
  skipped so that no arrival is left pending at exit.
- Named barrier ids: 0 is __syncthreads; 1 + wg: a consumer warpgroup's epilogue; 3, 4: ping-pong turns.
"""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

CONSUMER_WARPS_PER_WG = 4
EPILOGUE_BARRIER = 1  # + consumer warpgroup index
PINGPONG_BARRIER = 3  # + consumer warpgroup index


def make_tma_pipeline(barrier_ptr, num_stages: int, tx_bytes: int, num_consumer_wg: int):
    """A TMA-fed pipeline: one producer thread arms the barrier, each consumer warp releases."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_WARPS_PER_WG * num_consumer_wg),
        tx_count=tx_bytes,
        defer_sync=True,
    )


def producer_state(num_stages: int):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, num_stages)


def consumer_state(num_stages: int):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, num_stages)


@cute.jit
def pingpong_start(wg: Int32, enabled: cutlass.Constexpr):
    """Warpgroup 1 hands the first turn to warpgroup 0."""
    if cutlass.const_expr(enabled):
        if wg == 1:
            cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER, number_of_threads=256)


@cute.jit
def pingpong_wait(wg: Int32, enabled: cutlass.Constexpr):
    """Waits for this warpgroup's turn to issue its matmul."""
    if cutlass.const_expr(enabled):
        cute.arch.barrier(barrier_id=PINGPONG_BARRIER + wg, number_of_threads=256)


@cute.jit
def pingpong_pass(wg: Int32, is_last: cutlass.Boolean, enabled: cutlass.Constexpr):
    """Hands the turn to the other warpgroup (warpgroup 1 keeps its last one: nobody waits for it)."""
    if cutlass.const_expr(enabled):
        if wg == 0:
            cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER + 1, number_of_threads=256)
        elif not is_last:
            cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER, number_of_threads=256)


@cute.jit
def epilogue_sync(wg: Int32):
    """Barrier of one consumer warpgroup's 128 threads."""
    cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=128)
