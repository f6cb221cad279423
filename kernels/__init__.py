"""Kernels of the decode and prefill paths (Triton, CuTe-DSL). Each module declares its entries for the router
(kernels.registry); importing kernels.routes, model.ops' "triton" backend, registers them all."""
from kernels import interpreter_compat

interpreter_compat.apply()
