"""A fixed-order fp32 `tl.dot` for Triton's interpreter, so interpreted kernels get bits that
depend on the data alone, never on the machine's BLAS.

Stock, the interpreter computes `tl.dot(a, b, acc)` as `np.matmul(a, b) + acc`: OpenBLAS
picks its kernel and blocking from the CPU (and from OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE), so
an element's bits may depend on the tile's other rows and columns, and the accumulator is
added last. `fma_chain` computes every element as the chain

    c = acc;  for k = 0, 1, ..., K - 1:  c = fma(a[m, k], b[k, n], c)

in fp32, each fma correctly rounded (to nearest, ties to even): a function of the element's
own row, column and accumulator only. It is the order in which Triton lowers an fp32
`input_precision="ieee"` dot on the GPU (one FMA per k, from the accumulator): on an H200
(Triton 3.6) `tl.dot` tiles of 16 to 128 rows, 1 to 8 warps, and `linear.tree_mm` in fp32 at
K = 1024 to 5632 gave these bits in every element. For bf16 and fp16 inputs it is a fixed
model, not the tensor core's order; the GPU tests cover that.

`install()` puts it in place of the interpreter's dot; `installed()` says whether it is.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime import interpreter

_STOCK_DOT = interpreter.InterpreterBuilder.create_dot
"""The interpreter's own dot (np.matmul, then + acc), kept for the negative control."""


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma(a, b, c) elementwise, rounded once: a, b, c fp32 arrays (broadcast).

    a * b is exact in float64 (24 + 24 bits <= 53). The sum with c is formed in float64 and
    rounded to odd: TwoSum gives its rounding error, and an inexact result with an even last
    bit moves one float64 ulp towards the error. Round-to-odd at 53 bits, then round to
    nearest at 24, is the correctly rounded sum (53 >= 24 + 2), with no double-rounding tie.
    """
    with np.errstate(all="ignore"):  # inf and NaN propagate as IEEE says; TwoSum is moot there
        c64 = c.astype(np.float64)
        p = a.astype(np.float64) * b.astype(np.float64)
        s = c64 + p
        bb = s - c64
        err = (c64 - (s - bb)) + (p - bb)
        bits = s.view(np.int64)
        fix = (err != 0) & ((bits & 1) == 0) & np.isfinite(s)
        # On the integer view, +1 grows |s| for either sign: grow it when err has s's sign.
        step = np.where(np.signbit(err) == np.signbit(s), 1, -1)
        s = np.where(fix, bits + step, bits).view(np.float64)
        return s.astype(np.float32)


def fma_chain(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a @ b as one fp32 fma per k in ascending k, starting from acc: a [..., M, K],
    b [..., K, N], acc [..., M, N] fp32 (a, b fp32 or exactly representable in fp32)."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    c = np.array(acc, dtype=np.float32, copy=True)
    for k in range(a32.shape[-1]):
        c = fma_f32(a32[..., :, k, None], b32[..., None, k, :], c)
    return c


def _as_f32(h: interpreter.TensorHandle) -> np.ndarray:
    """A dot operand's values as fp32 (exact for every input type a float dot accepts)."""
    dt = h.dtype.scalar
    if dt == tl.float32:
        return h.data
    if dt == tl.bfloat16:  # the interpreter stores bf16 as its uint16 bits
        return (h.data.astype(np.uint32) << 16).view(np.float32)
    if dt == tl.float16:
        return h.data.astype(np.float32)
    if dt.is_floating() and dt.primitive_bitwidth == 8:
        half = interpreter._convert_float(h.data, dt, tl.float16, None).view(np.float16)
        return half.astype(np.float32)
    raise NotImplementedError(f"fixed-order interpreter dot: operands of type {dt}")


def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter builder's `create_dot`, as `fma_chain`."""
    if d.dtype.scalar != tl.float32:
        raise NotImplementedError(f"fixed-order interpreter dot: {d.dtype.scalar} accumulator")
    if a.dtype.scalar == tl.float32 and input_precision != ir.INPUT_PRECISION.IEEE:
        raise NotImplementedError(f"fixed-order interpreter dot: fp32 at {input_precision}")
    out = fma_chain(_as_f32(a), _as_f32(b), d.data)
    return interpreter.TensorHandle(out, d.dtype.scalar)


def stock_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """What the interpreter's own dot returns for fp32 a, b, acc."""
    h = interpreter.TensorHandle
    out = _STOCK_DOT(None, h(a, tl.float32), h(b, tl.float32), h(acc, tl.float32),
                     ir.INPUT_PRECISION.IEEE, 0)  # fmt: skip
    return out.data


def install() -> None:
    """Make every `tl.dot` the interpreter runs from now on the fixed-order chain."""
    interpreter.InterpreterBuilder.create_dot = create_dot


def installed() -> bool:
    return interpreter.InterpreterBuilder.create_dot is create_dot
