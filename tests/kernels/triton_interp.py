"""Shared by the kernel tests that run on the Triton interpreter when there is no GPU."""


def fix_interpreter_index() -> None:
    """triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses, so any
    loop with a runtime bound fails (triton-lang/triton#9171, fixed upstream the same way). Every interpreter
    user calls this first, so it also applies patch_language_once_per_launch (speed only)."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_index_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._index_fixed = True
    interpreter._patch_lang_tensor = patched
    patch_language_once_per_launch()


def patch_language_once_per_launch() -> None:
    """Speed only (the kernels run the same): a launch (GridExecutor) patches triton.language for the interpreter,
    then every call of a @triton.jit helper inside it patches the whole language again (inspect.getmembers over
    tl, tl.tensor, tl.math: about 1 ms a call, never undone), a third of the time of kernels that call helpers
    in their K loop. Inside a launch this patches once per launch for each set of language modules a helper's
    globals name (what the launch's own patch may not cover) and then calls the helper as the interpreter does."""
    from triton.runtime import interpreter

    orig_launch = interpreter.GridExecutor.__call__
    if getattr(orig_launch, "_once_per_launch", False):
        return
    orig_call = interpreter.InterpretedFunction.__call__
    state = {"depth": 0, "patched": set()}
    langs_of: dict = {}

    def launch(self, *args, **kwargs):
        state["depth"] += 1
        try:
            return orig_launch(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if state["depth"] == 0:
                state["patched"].clear()  # the launch's scope restored the language: the next one patches again

    def call(self, *args, **kwargs):
        if state["depth"] == 0:  # a helper called outside any launch: as the interpreter does
            return orig_call(self, *args, **kwargs)
        key = langs_of.get(self.fn)
        if key is None:
            key = langs_of[self.fn] = frozenset(id(v) for v in self.fn.__globals__.values()
                                               if v is interpreter.tl or v is interpreter.tl.core)
        if key not in state["patched"]:
            state["patched"].add(key)
            interpreter._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    launch._once_per_launch = True
    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call


def fix_interpreter_bf16() -> None:
    """The interpreter casts float32 -> bfloat16 by truncation (``x.to(tl.bfloat16)`` passes no rounding
    mode) or, asked for rtne, rounds ties up and lets the carry spill; the GPU rounds to nearest even
    (cvt.rn.bf16.f32). Tests that compare bf16 kernels bit for bit need the GPU's rounding: torch's."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter._convert_float
    if getattr(orig, "_bf16_fixed", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            src = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32).reshape(-1))
            return src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(np.shape(input))
        return orig(input, input_dtype, output_dtype, rounding_mode)

    convert._bf16_fixed = True
    interpreter._convert_float = convert


def fix_interpreter_bf16_dot() -> None:
    """The interpreter's tl.dot multiplies bf16 tiles as the raw uint16 it stores them in; this widens them to
    the float32 they are exactly (bits << 16) first, so bf16 kernels compute real products, accumulated in
    float32 per tile by numpy, identically for any two kernels with the same tiles."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.create_dot
    if getattr(orig, "_bf16_fixed", False):
        return

    def widen(h):
        if h.dtype.scalar != tl.bfloat16 if hasattr(h.dtype, "scalar") else h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    patched._bf16_fixed = True
    interpreter.InterpreterBuilder.create_dot = patched
