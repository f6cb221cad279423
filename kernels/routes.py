"""The "triton" ops backend: importing this registers every kernel's entries in the router (kernels.registry).

Each kernel module declares its own entries (what it supports, at what cost) beside its kernels; this is the list
of them. fa4 registers its forwards in fa4.routes; model.ops imports both when the backend is chosen.
"""
from kernels import (  # noqa: F401  (imported for their registrations)
    activations,
    argmax,
    attention_prep,
    gather_rows,
    gdn_decode,
    gdn_prefill,
    gdn_verify,
    linear,
    moe,
    moe_gemv,
    norms,
    paged_decode_attention,
)
