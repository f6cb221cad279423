"""The "triton" backend of model.ops: every op this package has a kernel for. Importing registers it.
gated_deltanet dispatches itself: the decode step for one token per sequence, the chunked prefill otherwise."""
from kernels import activations, argmax, attention_prep, gather_rows, gdn_prefill, linear, norms, paged_decode_attention
from model import ops

TRITON_OPS = {**norms.OPS, **activations.OPS, **linear.OPS, **attention_prep.OPS, **gdn_prefill.OPS,
              **paged_decode_attention.OPS, **argmax.OPS, **gather_rows.OPS}
ops.register_backend("triton", TRITON_OPS)
