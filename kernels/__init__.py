"""Triton kernels of the decode path; `kernels.backend` registers them as model.ops' "triton" backend."""
from kernels import interpreter_compat

interpreter_compat.apply()
