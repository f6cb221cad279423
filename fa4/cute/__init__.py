"""CuTe-DSL FlashAttention forward for Hopper (sm_90a); see kernel.py for the structure.

Importing this package needs nvidia-cutlass-dsl; `fa4.cute.config` alone does not.
"""
