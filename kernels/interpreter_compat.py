"""Makes triton 3.6's CPU interpreter (TRITON_INTERPRET=1) run loops with runtime bounds under numpy >= 2.4.

The interpreter turns a runtime loop bound into an int through a 1-element numpy array, which numpy 2.4
refuses ("only 0-dimensional arrays can be converted to Python scalars"); later triton releases squeeze the
array first. This applies the same squeeze, once, and only when the interpreter is on.

INTERPRET (kernels.environment): whether Triton runs its CPU interpreter; the kernel modules ask it here.
"""
from kernels.environment import INTERPRET


def apply() -> None:
    if not INTERPRET:
        return
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor
    if getattr(original, "scalar_index_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched
