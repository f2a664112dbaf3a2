"""The Triton kernels behind ``execute.kernels.delta_blocks``, imported at their first
launch (module-level: a kernel calls ``diff_tile``, which Triton finds among the module's
globals)."""

import triton
import triton.language as tl

__all__ = ["diff_tiles", "gather_tiles", "apply_blocks", "diff_small", "gather_small", "apply_small"]


@triton.jit
def diff_tile(cur, ref, offs, inside, t, counts, starts, pos_out, val_out, total, slot, limit,
              CAST: tl.constexpr, WIRE: tl.constexpr, BF16_RNE: tl.constexpr):
    b = tl.load(ref + offs, mask=inside, other=0)
    a = tl.load(cur + offs, mask=inside, other=0)
    if BF16_RNE:  # the interpreter: bfloat16 rounded to nearest even in integers, as torch on CPU
        u = a.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        a = r.to(tl.uint16).to(tl.int16, bitcast=True)
    elif CAST:  # the wire dtype's bits of the cast: the device's cast instruction, as torch's
        a = a.to(WIRE).to(b.dtype, bitcast=True)
    changed = (a != b) & inside
    n = tl.sum(changed.to(tl.int32), axis=0)
    tl.store(ref + offs, a, mask=changed)
    tl.store(counts + t, n)
    if n > 0:
        cap = tl.load(limit)
        start = tl.atomic_add(total + slot, n.to(tl.int64))  # room in this element size's scratch
        tl.store(starts + t, start)
        if start + n <= cap:
            at = start + tl.cumsum(changed.to(tl.int32), axis=0) - 1
            tl.store(pos_out + at, (offs & 0xFFFF).to(tl.int16), mask=changed)
            tl.store(val_out + at, a, mask=changed)

@triton.jit
def copy_run(pos_in, val_in, pos_out, val_out, n, CHUNK: tl.constexpr):
    # n positions and values from one place of the scratch to one of the payload
    i = tl.arange(0, CHUNK)
    j = n * 0
    while j < n:  # while, not range(): the interpreter takes no loaded bound
        k = j + i
        m = k < n
        tl.store(pos_out + k, tl.load(pos_in + k, mask=m), mask=m)
        tl.store(val_out + k, tl.load(val_in + k, mask=m), mask=m)
        j += CHUNK

@triton.jit
def diff_tiles(cur, ref, numel, counts, starts, pos_out, val_out, total, slot, limit,
               TILE: tl.constexpr, CAST: tl.constexpr, WIRE: tl.constexpr, BF16_RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = t * TILE + tl.arange(0, TILE)
    diff_tile(cur, ref, offs, offs < numel, t, counts, starts, pos_out, val_out, total, slot, limit,
              CAST, WIRE, BF16_RNE)

@triton.jit
def diff_small(table, counts, starts, pos_out, val_out, total, slot, limit, SRC: tl.constexpr,
               ELEM: tl.constexpr, TILE: tl.constexpr, PER: tl.constexpr, CAST: tl.constexpr, WIRE: tl.constexpr,
               BF16_RNE: tl.constexpr):
    # parts of one block at most, PER (a block's) tiles each (the last ones empty): table rows of
    # (source address, reference address, elements)
    t = tl.program_id(0).to(tl.int64)
    p = t // PER
    offs = (t - p * PER) * TILE + tl.arange(0, TILE)
    cur = tl.load(table + p * 3).to(tl.pointer_type(SRC))
    mine = tl.load(table + p * 3 + 1).to(tl.pointer_type(ELEM))
    diff_tile(cur, mine, offs, offs < tl.load(table + p * 3 + 2), t, counts, starts, pos_out, val_out, total,
              slot, limit, CAST, WIRE, BF16_RNE)

@triton.jit
def gather_small(counts, starts, table, pos_in, val_in, ELEM: tl.constexpr, PER: tl.constexpr,
                 CHUNK: tl.constexpr):
    # table rows: addresses of the part's block count, positions and values in the
    # payload (0: the part did not change)
    t = tl.program_id(0).to(tl.int64)
    p = t // PER
    lt = t - p * PER
    c_at = tl.load(table + p * 3)
    if c_at != 0:
        r = tl.arange(0, PER)
        cs = tl.load(counts + p * PER + r)
        if lt == 0:
            tl.store(c_at.to(tl.pointer_type(tl.int32)), tl.sum(cs, axis=0))
        n = tl.load(counts + t)
        if n > 0:
            dst = tl.sum(tl.where(r < lt, cs, 0), axis=0)  # the part's changes in tiles before this one
            src = tl.load(starts + t)
            pos_out = tl.load(table + p * 3 + 1).to(tl.pointer_type(tl.int16))
            val_out = tl.load(table + p * 3 + 2).to(tl.pointer_type(ELEM))
            copy_run(pos_in + src, val_in + src, pos_out + dst, val_out + dst, n, CHUNK)

@triton.jit
def apply_small(table, ELEM: tl.constexpr, CHUNK: tl.constexpr):
    # one part of one block each; table rows: addresses of its block count, positions
    # and values in the payload, and of its destination
    p = tl.program_id(0).to(tl.int64)
    n = tl.load(tl.load(table + p * 4).to(tl.pointer_type(tl.int32)))
    pos_in = tl.load(table + p * 4 + 1).to(tl.pointer_type(tl.int16))
    val_in = tl.load(table + p * 4 + 2).to(tl.pointer_type(ELEM))
    out = tl.load(table + p * 4 + 3).to(tl.pointer_type(ELEM))
    i = tl.arange(0, CHUNK)
    j = n * 0
    while j < n:
        k = j + i
        m = k < n
        low = tl.load(pos_in + k, mask=m, other=0).to(tl.int32) & 0xFFFF
        tl.store(out + low, tl.load(val_in + k, mask=m), mask=m)
        j += CHUNK

@triton.jit
def gather_tiles(counts, starts, prefix, pos_in, val_in, pos_out, val_out, CHUNK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(counts + t)
    if n > 0:
        src = tl.load(starts + t)
        dst = tl.load(prefix + t)
        copy_run(pos_in + src, val_in + src, pos_out + dst, val_out + dst, n, CHUNK)

@triton.jit
def apply_blocks(counts, prefix, pos_in, val_in, dst, CHUNK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(counts + b)
    if n > 0:
        at = tl.load(prefix + b)
        i = tl.arange(0, CHUNK)
        j = n * 0
        while j < n:
            k = j + i
            m = k < n
            low = tl.load(pos_in + at + k, mask=m, other=0).to(tl.int32) & 0xFFFF
            v = tl.load(val_in + at + k, mask=m)
            tl.store(dst + (b * 65536 + low), v, mask=m)
            j += CHUNK
