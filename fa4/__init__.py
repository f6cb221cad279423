"""FA4-style attention for sm_90: `flash_attention` (fa4/interface.py) over Triton and reference backends."""
from kernels import interpreter_compat

interpreter_compat.apply()

from fa4.interface import flash_attention  # noqa: E402

__all__ = ["flash_attention"]
