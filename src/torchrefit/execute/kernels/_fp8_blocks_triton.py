"""The Triton kernel behind ``execute.kernels.fp8_blocks`` (imported only when it first
runs: Triton is optional). ``execute.kernels.fp8_blocks``'s docstring says what it computes and why
the arithmetic is bit-identical to ``transforms.fp8.quantize_blocks``."""

import triton
import triton.language as tl

__all__ = ["quantize_blocks_kernel"]


@triton.jit
def _tile(src, stride, r, c, rows, cols, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(src + r * stride + c).to(tl.float32)
    return tl.load(src + r * stride + c, mask=(r < rows) & (c < cols), other=0.0).to(tl.float32)

@triton.jit
def _put(dst, stride, r, c, rows, cols, x, s, inv, EVEN: tl.constexpr):
    q0 = x * inv
    q = tl.fma(tl.fma(-q0, s, x), inv, q0)
    # the sign of x (division is sign-symmetric): -0 would come out +0 otherwise
    q = ((q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF)
         | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)
    if EVEN:
        tl.store(dst + r * stride + c, q.to(tl.float8e4nv))
    else:
        tl.store(dst + r * stride + c, q.to(tl.float8e4nv), mask=(r < rows) & (c < cols))

@triton.jit
def quantize_blocks_kernel(table, BR: tl.constexpr, BC: tl.constexpr, SRC: tl.constexpr,
                           EVEN: tl.constexpr, CHUNK: tl.constexpr):
    row = table + tl.program_id(0).to(tl.int64) * 7
    src = tl.load(row).to(tl.pointer_type(SRC))
    # offsets inside one block fit in 32 bits (the table checks strides): 64-bit
    # offsets per element doubled the registers and halved the blocks in flight
    src_stride = tl.load(row + 1).to(tl.int32)
    dst = tl.load(row + 2).to(tl.pointer_type(tl.float8e4nv))
    dst_stride = tl.load(row + 3).to(tl.int32)
    scale = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    rows = tl.load(row + 5).to(tl.int32)
    cols = tl.load(row + 6).to(tl.int32)
    if EVEN:  # what the table promises: lets Triton load and store 16 bytes at a time
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        src_stride = tl.multiple_of(src_stride, 16)
        dst_stride = tl.multiple_of(dst_stride, 16)
    r = tl.arange(0, CHUNK)[:, None]
    c = tl.arange(0, BC)[None, :]
    if CHUNK == BR:
        x = _tile(src, src_stride, r, c, rows, cols, EVEN)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        _put(dst, dst_stride, r, c, rows, cols, x, s, tl.math.div_rn(1.0, s), EVEN)
    else:
        amax = tl.zeros((), dtype=tl.float32)
        for r0 in tl.range(0, BR, CHUNK):
            x = _tile(src, src_stride, r0 + r, c, rows, cols, EVEN)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        inv = tl.math.div_rn(1.0, s)
        for r0 in tl.range(0, BR, CHUNK):
            x = _tile(src, src_stride, r0 + r, c, rows, cols, EVEN)
            _put(dst, dst_stride, r0 + r, c, rows, cols, x, s, inv, EVEN)
    tl.store(scale, s)
