"""Kernels of the decode and prefill paths (Triton, CuTe-DSL); `kernels.routes` registers each kernel's entries as
model.ops' "triton" backend in the router, `kernels.registry`."""
from kernels import interpreter_compat

interpreter_compat.apply()
