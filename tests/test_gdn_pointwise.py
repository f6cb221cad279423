"""The GDN gates and gated output norm kernels (kernels/gdn_pointwise.py) against reference.gdn_gates and
reference.gated_rms_norm, on strided views like the model's (slices of one projection output)."""
import pytest
import torch
from conftest import assert_rel

import reference as R
from kernels.gdn_pointwise import gated_rms_norm, gdn_gates

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("n,h", [(1, 16), (65, 48), (300, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_match_reference(n, h, dtype):
    ab = randn(n, 2 * h + 5, seed=n, dtype=dtype, scale=8.0)  # wide values: softplus' threshold both ways
    a, b = ab[:, :h], ab[:, h + 5:]  # strided rows, as the model's slices of one projection
    a_log, dt_bias = randn(h, seed=1), randn(h, seed=2)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    ref_g, ref_beta = R.gdn_gates(a, b, a_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.is_contiguous()
    assert_rel(g, ref_g, 1e-6, "g")
    assert_rel(beta, ref_beta, 1e-6, "beta")


# Triton 3.6's interpreter truncates fp32 -> bf16 casts instead of rounding: the norm's three roundings then
# differ from torch's in most elements, so bf16 runs on the GPU only
BF16_ON_GPU = pytest.param(torch.bfloat16, marks=pytest.mark.gpu)


@pytest.mark.parametrize("n,h,dv", [(1, 2, 16), (65, 3, 128), (17, 32, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_ON_GPU])
def test_gated_norm_matches_reference(n, h, dv, dtype):
    x = randn(n, h, dv, seed=n + dv, dtype=dtype)
    wide = randn(n, h * dv + 7, seed=3, dtype=dtype)
    z = wide[:, 7:].view(n, h, dv)  # token stride != h * dv
    w = randn(dv, seed=4, dtype=dtype, scale=0.3) + 1
    out = gated_rms_norm(x, z, w, 1e-6)
    ref = R.gated_rms_norm(x, z, w, 1e-6)
    assert out.dtype == dtype and out.is_contiguous()
    assert_rel(out.float(), ref.float(), TOL[dtype], f"gated norm {dtype}")


def test_empty_batches():
    g, beta = gdn_gates(*(randn(0, 4, seed=0) for _ in range(2)), randn(4, seed=1), randn(4, seed=2))
    assert g.shape == beta.shape == (0, 4)
    assert gated_rms_norm(randn(0, 2, 16, seed=0), randn(0, 2, 16, seed=1), randn(16, seed=2), 1e-6).shape == (0, 2, 16)


@pytest.mark.parametrize("name, call", [
    ("b", lambda: gdn_gates(randn(3, 4, seed=0), randn(3, 5, seed=0), randn(4, seed=0), randn(4, seed=0))),
    ("a", lambda: gdn_gates(randn(3, 4, seed=0).to(torch.int32), randn(3, 4, seed=0), randn(4, seed=0),
                            randn(4, seed=0))),
    ("A_log", lambda: gdn_gates(randn(3, 4, seed=0), randn(3, 4, seed=0), randn(4, 1, seed=0), randn(4, seed=0))),
    ("a", lambda: gdn_gates(randn(4, 3, seed=0).t(), randn(3, 4, seed=0), randn(4, seed=0), randn(4, seed=0))),
    ("z", lambda: gated_rms_norm(randn(2, 3, 16, seed=0), randn(2, 3, 8, seed=0), randn(16, seed=0), 1e-6)),
    ("z", lambda: gated_rms_norm(randn(2, 3, 16, seed=0), randn(2, 3, 16, seed=0).half(), randn(16, seed=0), 1e-6)),
    ("weight", lambda: gated_rms_norm(randn(2, 3, 16, seed=0), randn(2, 3, 16, seed=0), randn(8, seed=0), 1e-6)),
    ("x", lambda: gated_rms_norm(randn(2, 16, 3, seed=0).transpose(1, 2), randn(2, 3, 16, seed=0),
                                 randn(16, seed=0), 1e-6)),
])
def test_bad_arguments_name_the_argument(name, call):
    with pytest.raises(ValueError, match=name):
        call()
