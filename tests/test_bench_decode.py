"""profiles.bench_decode on the CPU: the arguments its GPU sweeps build are what the ops take."""
import torch

from model import ops
from profiles.bench_decode import _gdn_stretch_layer


def test_gdn_stretch_layer_is_what_the_op_takes():
    layer = _gdn_stretch_layer(256, 2, 4, dev="cpu")
    states = layer["recurrent_states"].clone()
    with ops.use_backend("reference"):
        out, s = ops.in_proj_gated_deltanet(**layer)
    assert out.shape == (1, 4 * 128) and s.shape == (1, 256) and torch.isfinite(out.float()).all()
    assert not torch.equal(states, layer["recurrent_states"])  # the step moved the state in place
