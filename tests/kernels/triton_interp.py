"""Shared by the kernel tests that run on the Triton interpreter when there is no GPU."""


def fix_interpreter_index() -> None:
    """triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses, so any
    loop with a runtime bound fails (triton-lang/triton#9171, fixed upstream the same way)."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_index_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._index_fixed = True
    interpreter._patch_lang_tensor = patched
