"""The environment, read once, at import: the one place the package reads it.

TRITON_INTERPRET=1: Triton runs its CPU interpreter (Triton reads it at import too).
QWEN_PDL=0: no programmatic dependent launch in this process (the initial kernels.tuning.KernelTuning's pdl).
QWEN_CHECK_OPS=1: the op path runs each implementation's checked entry (kernels.registry.run).
"""
import os

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PDL = os.environ.get("QWEN_PDL") != "0"
CHECK_OPS = os.environ.get("QWEN_CHECK_OPS") == "1"
