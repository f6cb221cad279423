"""kernels/l2_policy.py: the persisting L2 limit (a no-op off CUDA; raised, capped and never lowered on a GPU)."""
import pytest
import torch

from kernels import l2_policy


def test_reserve_is_a_no_op_on_the_cpu():
    assert l2_policy.reserve(torch.device("cpu"), 1 << 20) == 0


@pytest.mark.gpu
def test_reserve_raises_the_limit_up_to_the_device_maximum():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import cuda.bindings.driver as cu
    dev = torch.device("cuda", torch.cuda.current_device())
    most = l2_policy.max_persisting_bytes(dev.index)
    assert l2_policy.reserve(dev, 1 << 20) == min(1 << 20, most)
    assert l2_policy.reserve(dev, 1 << 10) == min(1 << 20, most)  # never lowered
    assert l2_policy.reserve(dev, 1 << 40) == most
    err, limit = cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
    assert err == cu.CUresult.CUDA_SUCCESS and limit >= most * 0.9  # the driver may round it
