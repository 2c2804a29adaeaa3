"""Triton's CPU interpreter made to compute what the GPU computes (`patch_interpreter`), for tests and the EP
rank processes they start (libs/ep/_preload.py applies it when TRITON_INTERPRET=1). Each patch below fixes one
place where Triton 3.6's interpreter differs from the GPU or breaks a later compile."""

# `__index__`: it converts a loaded scalar with `int(array)`, which NumPy 2 refuses for one-element arrays
# (kernels with run-time loop bounds need it). float32 -> float8: it drops the carry when rounding overflows
# the mantissa (127.9 -> 64); torch does the cast instead, rounding to nearest as the GPU does.
# `tl.dot`: it multiplies bfloat16 operands as their raw 16-bit patterns; they are widened to float32 first
# (FP8 ones too, by torch: exact, where the interpreter's bitwise cast to float16 is ~10x slower).
# Device-function calls (`tl.cdiv` and the other standard helpers) patch triton.language.core and never
# restore it, breaking any later Gluon compile in the process; the call is wrapped to undo its patches.

from __future__ import annotations

import torch


def patch_interpreter() -> None:
    """Apply the fixes above (once; a no-op without Triton)."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # triton missing: the tests skip on import
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_moemesh_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._moemesh_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched

    import numpy as np
    import triton.language as tl

    builder_cls = interpreter.InterpreterBuilder
    original_fp_to_fp = builder_cls.create_fp_to_fp

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            data = wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(data, dst_type.scalar)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder_cls.create_fp_to_fp = fp_to_fp
    original_dot = builder_cls.create_dot

    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def widen(t):
        if t.dtype.scalar in fp8:
            wide = torch.from_numpy(t.data).view(fp8[t.dtype.scalar]).float().numpy()
            return interpreter.TensorHandle(wide, tl.float32)
        if t.dtype.scalar != tl.bfloat16:
            return t
        return interpreter.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = dot

    def device_call(self, *args, **kwargs):
        scope = interpreter._patch_lang(self.fn)
        try:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    interpreter.InterpretedFunction.__call__ = device_call
    _list_builtins_once(interpreter, tl)
    _np_dtypes_once(interpreter, tl)


def _list_builtins_once(interpreter, tl) -> None:
    """Speed only: each launch and device-function call re-patches triton.language, finding its builtins with
    inspect.getmembers (~0.4 ms; a fused forward makes thousands): listed once, unpatched, here; a nested call
    re-patches only what its caller did not, as upstream."""
    import inspect

    pkgs = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    listed = {id(p): [(n, m) for n, m in inspect.getmembers(p) if tl.core.is_builtin(m)] for p in pkgs}
    original = interpreter._patch_builtin

    def patch_builtin(pkg, builder, scope):
        members = listed.get(id(pkg))
        if members is None:
            return original(pkg, builder, scope)
        for name, member in members:
            if getattr(pkg, name, None) is member:  # else an enclosing call's patch holds, as upstream
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


def _np_dtypes_once(interpreter, tl) -> None:
    """Speed only: the interpreter's `_get_np_dtype` builds its 18-entry table on every call (several per op);
    the table is built once here and answers the same."""
    import numpy as np

    table = {
        t: interpreter._get_np_dtype(t)
        for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
                  tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16,
                  tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)
    }  # fmt: skip
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        return pointer if isinstance(tt_dtype, tl.pointer_type) else table[tt_dtype]

    interpreter._get_np_dtype = get_np_dtype
