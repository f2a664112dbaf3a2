"""Delta refits' diff and apply on CPU as one native pass each, where built.

The torch-op form of the diff (``execute.delta``) is a chain: a compare into a mask, a
search of the mask, gathers, a compare of the gathered words, an encode; each step a pass
over memory, about 50 ns per changed element all told. Here the sender's diff is one pass
over the source and its reference, 8 bytes at a time (a cache line at a time where none
differ), that writes the positions and values of changed elements straight into the
sparse payload and brings the reference up to date in the same pass; the receiver's
apply is one pass over the payload. The wire format is the torch path's, bit for bit,
so a native sender and a torch-op receiver (or the reverse) understand each other.

It is plain C++ (no torch headers: it sees addresses and sizes), compiled in about a
second with the C++ compiler (``$CXX``, else ``c++``) into the kernel cache
(``_util.cache_dir``'s root, ``.../torchrefit/native/delta-<key>``) and loaded with
``ctypes``, which releases the GIL for each call. :func:`kernels` returns it where it is
built; where it is not, the first call starts a build on a thread of its own and returns
None, and the torch ops run until the build landed (a refit never waits for a compiler).
:func:`build` builds now (``torchrefit native build``, tests and benchmarks).
``settings.native_delta`` off: the torch ops only, no build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

from .. import settings
from .._util.cache_dir import cache_dir
from .compile import compile_library

__all__ = ["SOURCE", "Kernels", "build", "built_path", "kernels", "wait"]

_log = logging.getLogger("torchrefit")

SOURCE = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <mutex>
#include <thread>
#include <vector>

namespace {
constexpr int64_t kBlock = int64_t(1) << 16;
inline int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

struct Buf {  // grows, never shrinks: kept across calls so its pages fault in once
  uint8_t* p = nullptr;
  size_t cap = 0;
  bool ensure(size_t n) {
    if (n <= cap) return true;
    size_t c = std::max(n, cap * 2);
    void* q = std::realloc(p, c);
    if (!q) return false;
    p = static_cast<uint8_t*>(q);
    cap = c;
    return true;
  }
};

struct Found {
  Buf pos, vals;
  int64_t k = 0;
  bool over = false;
};

// Bit i set where element i of a 64-byte line (elements of S bytes) differs: one vector
// compare per 16 bytes, so a line costs the same few instructions whatever changed in it.
template <int S> uint64_t changed64(const uint8_t* a, const uint8_t* b);
#if defined(__SSE2__)
#include <emmintrin.h>
inline __m128i at16(const uint8_t* p, int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)); }
template <> inline uint64_t changed64<1>(const uint8_t* a, const uint8_t* b) {
  uint64_t eq = 0;
  for (int i = 0; i < 4; ++i)
    eq |= uint64_t(uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi8(at16(a, i), at16(b, i))))) << (16 * i);
  return ~eq;
}
template <> inline uint64_t changed64<2>(const uint8_t* a, const uint8_t* b) {
  // equal lanes are all ones: packed to bytes (saturating), one mask bit per element
  const __m128i lo = _mm_packs_epi16(_mm_cmpeq_epi16(at16(a, 0), at16(b, 0)), _mm_cmpeq_epi16(at16(a, 1), at16(b, 1)));
  const __m128i hi = _mm_packs_epi16(_mm_cmpeq_epi16(at16(a, 2), at16(b, 2)), _mm_cmpeq_epi16(at16(a, 3), at16(b, 3)));
  const uint64_t eq = uint32_t(_mm_movemask_epi8(lo)) | (uint64_t(uint32_t(_mm_movemask_epi8(hi))) << 16);
  return ~eq & 0xFFFFFFFFull;
}
template <> inline uint64_t changed64<4>(const uint8_t* a, const uint8_t* b) {
  const __m128i lo = _mm_packs_epi32(_mm_cmpeq_epi32(at16(a, 0), at16(b, 0)), _mm_cmpeq_epi32(at16(a, 1), at16(b, 1)));
  const __m128i hi = _mm_packs_epi32(_mm_cmpeq_epi32(at16(a, 2), at16(b, 2)), _mm_cmpeq_epi32(at16(a, 3), at16(b, 3)));
  return ~uint64_t(uint32_t(_mm_movemask_epi8(_mm_packs_epi16(lo, hi)))) & 0xFFFFull;
}
#else
template <> inline uint64_t changed64<1>(const uint8_t* a, const uint8_t* b) {
  uint64_t m = 0;
  for (int i = 0; i < 64; ++i) m |= uint64_t(a[i] != b[i]) << i;
  return m;
}
template <> inline uint64_t changed64<2>(const uint8_t* a, const uint8_t* b) {
  uint64_t m = 0;
  for (int i = 0; i < 32; ++i) m |= uint64_t(std::memcmp(a + 2 * i, b + 2 * i, 2) != 0) << i;
  return m;
}
template <> inline uint64_t changed64<4>(const uint8_t* a, const uint8_t* b) {
  uint64_t m = 0;
  for (int i = 0; i < 16; ++i) m |= uint64_t(std::memcmp(a + 4 * i, b + 4 * i, 4) != 0) << i;
  return m;
}
#endif
template <> inline uint64_t changed64<8>(const uint8_t* a, const uint8_t* b) {
  uint64_t m = 0;
  for (int i = 0; i < 8; ++i) {
    uint64_t x, y;
    std::memcpy(&x, a + 8 * i, 8);
    std::memcpy(&y, b + 8 * i, 8);
    m |= uint64_t(x != y) << i;
  }
  return m;
}

template <int S> struct Int;
template <> struct Int<1> { using T = uint8_t; };
template <> struct Int<2> { using T = uint16_t; };
template <> struct Int<4> { using T = uint32_t; };
template <> struct Int<8> { using T = uint64_t; };

template <int S>
inline void lanes(uint64_t a, uint64_t b, int64_t at, uint16_t* pos, uint8_t* vals, int64_t& k) {
  // branchless: every lane is written at k, and k moves past it only where it changed
  // (changed lanes come at random: a branch per lane would mispredict)
  using T = typename Int<S>::T;
  constexpr int per = 8 / S;
  int64_t kk = k;
  for (int l = 0; l < per; ++l) {
    const T x = static_cast<T>(a >> (8 * S * l)), y = static_cast<T>(b >> (8 * S * l));
    pos[kk] = static_cast<uint16_t>(at + l);
    std::memcpy(vals + kk * S, &x, S);
    kk += (x != y);
  }
  k = kk;
}

// Blocks [b0, b1) of a part: changed elements' positions within their block and values
// into f, changed counts per block into counts, the reference updated where it differs.
template <int S>
void scan(const uint8_t* cur, uint8_t* ref, int64_t numel, int64_t b0, int64_t b1, int32_t* counts,
          Found& f, int64_t cap) {
  using T = typename Int<S>::T;
  constexpr int per = 8 / S;
  f.k = 0;
  f.over = false;
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t s = blk * kBlock, e = std::min(s + kBlock, numel), n = e - s;
    if (!f.pos.ensure(2 * (f.k + n)) || !f.vals.ensure(S * (f.k + n))) { f.over = true; return; }
    uint16_t* pos = reinterpret_cast<uint16_t*>(f.pos.p);
    uint8_t* vals = f.vals.p;
    const int64_t before = f.k;
    int64_t k = f.k;
    const uint8_t* c = cur + s * S;
    uint8_t* r = ref + s * S;
    const int64_t nw = n / per;
    int64_t w = 0;
    for (; w + 8 <= nw; w += 8) {  // a cache line at a time: most lines hold no change
      uint64_t m = changed64<S>(c + 8 * w, r + 8 * w);
      if (!m) continue;
      std::memcpy(r + 8 * w, c + 8 * w, 64);  // the whole line: its unchanged elements are equal
      const int64_t at = w * per;
      do {  // one step per changed element
        const int i = __builtin_ctzll(m);
        pos[k] = static_cast<uint16_t>(at + i);
        std::memcpy(vals + k * S, c + 8 * w + i * S, S);
        ++k;
        m &= m - 1;
      } while (m);
    }
    for (; w < nw; ++w) {
      uint64_t a, b;
      std::memcpy(&a, c + 8 * w, 8);
      std::memcpy(&b, r + 8 * w, 8);
      if (a != b) {
        std::memcpy(r + 8 * w, &a, 8);
        lanes<S>(a, b, w * per, pos, vals, k);
      }
    }
    for (int64_t i = nw * per; i < n; ++i) {  // the tail: fewer elements than a word
      T x, y;
      std::memcpy(&x, c + i * S, S);
      std::memcpy(&y, r + i * S, S);
      if (x != y) {
        std::memcpy(r + i * S, &x, S);
        pos[k] = static_cast<uint16_t>(i);
        std::memcpy(vals + k * S, &x, S);
        ++k;
      }
    }
    f.k = k;
    counts[blk] = static_cast<int32_t>(k - before);
    if (k > cap) { f.over = true; return; }
  }
}

std::mutex gate;                 // one encode at a time uses the kept buffers
std::vector<Found> kept(1);

template <int S>
int64_t encode(const uint8_t* cur, uint8_t* ref, int64_t numel, uint8_t* out, int64_t out_cap, int64_t cap,
               int threads) {
  std::lock_guard<std::mutex> hold(gate);
  const int64_t nblocks = (numel + kBlock - 1) / kBlock;
  const int64_t c0 = align16(4 * nblocks);
  if (c0 > out_cap) return -1;
  int32_t* counts = reinterpret_cast<int32_t*>(out);
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, nblocks)));
  if (static_cast<int>(kept.size()) < t) kept.resize(t);
  std::vector<int64_t> starts(t + 1);
  for (int i = 0; i <= t; ++i) starts[i] = nblocks * i / t;
  if (t == 1) {
    scan<S>(cur, ref, numel, 0, nblocks, counts, kept[0], cap);
  } else {
    std::vector<std::thread> pool;
    for (int i = 1; i < t; ++i)
      pool.emplace_back([&, i] { scan<S>(cur, ref, numel, starts[i], starts[i + 1], counts, kept[i], cap); });
    scan<S>(cur, ref, numel, starts[0], starts[1], counts, kept[0], cap);
    for (auto& th : pool) th.join();
  }
  int64_t k = 0;
  for (int i = 0; i < t; ++i) {
    if (kept[i].over) return -1;
    k += kept[i].k;
  }
  if (k > cap || c0 + align16(2 * k) + align16(S * k) > out_cap) return -1;
  uint8_t* pos = out + c0;
  uint8_t* vals = pos + align16(2 * k);
  for (int i = 0; i < t; ++i) {
    std::memcpy(pos, kept[i].pos.p, 2 * kept[i].k);
    std::memcpy(vals, kept[i].vals.p, S * kept[i].k);
    pos += 2 * kept[i].k;
    vals += S * kept[i].k;
  }
  return k;
}

// Blocks [b0, b1) of one part's encoding, whose first change is the i-th of the part.
template <int S>
void apply_blocks(const int32_t* counts, const uint8_t* pos8, const uint8_t* vals, int64_t b0, int64_t b1,
                  int64_t i, uint8_t* dst) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    uint8_t* base = dst + blk * kBlock * S;
    for (int64_t j = 0, m = counts[blk]; j < m; ++j, ++i) {
      uint16_t p;
      std::memcpy(&p, pos8 + 2 * i, 2);
      std::memcpy(base + int64_t(p) * S, vals + i * S, S);
    }
  }
}

// Blocks are independent: each thread takes a run of them, starting at the change its
// first block's count prefix names (scattered writes: latency-bound, so threads add up).
template <int S>
void apply(const uint8_t* part, int64_t numel, int64_t k, uint8_t* dst, int threads) {
  const int64_t nblocks = (numel + kBlock - 1) / kBlock;
  const int32_t* counts = reinterpret_cast<const int32_t*>(part);
  const uint8_t* pos8 = part + align16(4 * nblocks);
  const uint8_t* vals = pos8 + align16(2 * k);
  // a thread per 16k changes at least: fewer would spend more starting than writing
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, nblocks, k / 16384})));
  if (t == 1) {
    apply_blocks<S>(counts, pos8, vals, 0, nblocks, 0, dst);
    return;
  }
  std::vector<int64_t> first(t + 1, 0);
  std::vector<int64_t> bounds(t + 1);
  for (int i = 0; i <= t; ++i) bounds[i] = nblocks * i / t;
  for (int i = 0; i < t; ++i) {
    int64_t n = 0;
    for (int64_t blk = bounds[i]; blk < bounds[i + 1]; ++blk) n += counts[blk];
    first[i + 1] = first[i] + n;
  }
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i)
    pool.emplace_back([&, i] { apply_blocks<S>(counts, pos8, vals, bounds[i], bounds[i + 1], first[i], dst); });
  apply_blocks<S>(counts, pos8, vals, bounds[0], bounds[1], 0, dst);
  for (auto& th : pool) th.join();
}
}  // namespace

extern "C" {
int64_t torchrefit_delta_encode(const void* cur, void* ref, int64_t numel, int itemsize, void* out,
                                int64_t out_cap, int64_t cap, int threads) {
  auto c = static_cast<const uint8_t*>(cur);
  auto r = static_cast<uint8_t*>(ref);
  auto o = static_cast<uint8_t*>(out);
  switch (itemsize) {
    case 1: return encode<1>(c, r, numel, o, out_cap, cap, threads);
    case 2: return encode<2>(c, r, numel, o, out_cap, cap, threads);
    case 4: return encode<4>(c, r, numel, o, out_cap, cap, threads);
    case 8: return encode<8>(c, r, numel, o, out_cap, cap, threads);
  }
  return -2;
}

int torchrefit_delta_apply(const void* part, int64_t numel, int itemsize, int64_t k, void* dst, int threads) {
  auto p = static_cast<const uint8_t*>(part);
  auto d = static_cast<uint8_t*>(dst);
  switch (itemsize) {
    case 1: apply<1>(p, numel, k, d, threads); return 0;
    case 2: apply<2>(p, numel, k, d, threads); return 0;
    case 4: apply<4>(p, numel, k, d, threads); return 0;
    case 8: apply<8>(p, numel, k, d, threads); return 0;
  }
  return -2;
}

// Elements that differ in `runs` evenly spaced runs of `run` elements (the sample that
// judges a message dense before any diff: execute.delta._sampled_density's runs).
int64_t torchrefit_delta_sample(const void* cur, const void* ref, int64_t numel, int itemsize, int64_t runs,
                                int64_t run) {
  auto c = static_cast<const uint8_t*>(cur);
  auto r = static_cast<const uint8_t*>(ref);
  int64_t changed = 0;
  for (int64_t i = 0; i < runs; ++i) {
    const int64_t s = i * (numel / runs);
    for (int64_t j = s; j < s + run && j < numel; ++j)
      changed += std::memcmp(c + j * itemsize, r + j * itemsize, itemsize) != 0;
  }
  return changed;
}

// The physical floor of the diff: one read pass over a and b (a sum, so nothing is skipped).
uint64_t torchrefit_delta_read_floor(const void* a, const void* b, int64_t nbytes, int threads) {
  auto pa = static_cast<const uint8_t*>(a);
  auto pb = static_cast<const uint8_t*>(b);
  const int64_t nw = nbytes / 8;
  const int t = std::max(1, threads);
  std::vector<uint64_t> sums(t, 0);
  auto run = [&](int i) {
    uint64_t s = 0;
    for (int64_t w = nw * i / t, e = nw * (i + 1) / t; w < e; ++w) {
      uint64_t x, y;
      std::memcpy(&x, pa + 8 * w, 8);
      std::memcpy(&y, pb + 8 * w, 8);
      s += x ^ y;
    }
    sums[i] = s;
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) pool.emplace_back(run, i);
  run(0);
  for (auto& th : pool) th.join();
  uint64_t s = 0;
  for (auto v : sums) s += v;
  return s;
}
}
"""


class Kernels:
    """The loaded library's calls, typed. Every pointer is a CPU address of a tensor the
    caller keeps alive for the call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._encode = lib.torchrefit_delta_encode
        self._encode.argtypes = [vp, vp, i64, ci, vp, i64, i64, ci]
        self._encode.restype = i64
        self._apply = lib.torchrefit_delta_apply
        self._apply.argtypes = [vp, i64, ci, i64, vp, ci]
        self._apply.restype = ci
        self._sample = lib.torchrefit_delta_sample
        self._sample.argtypes = [vp, vp, i64, ci, i64, i64]
        self._sample.restype = i64
        self._floor = lib.torchrefit_delta_read_floor
        self._floor.argtypes = [vp, vp, i64, ci]
        self._floor.restype = ctypes.c_uint64

    def encode(self, cur: int, ref: int, numel: int, itemsize: int, out: int, out_cap: int, cap: int,
               threads: int) -> int:
        """Diff ``numel`` elements of ``itemsize`` bytes at ``cur`` against ``ref``, write
        one part's sparse encoding (block counts, 16-bit positions, values; the torch
        path's layout) at ``out``, and update ``ref`` where it differed. Returns the changed
        count, or -1 where more than ``cap`` changed or the encoding exceeds ``out_cap``
        bytes (then ``ref`` is partly updated: the caller sends the part dense, which
        overwrites it)."""
        return self._encode(cur, ref, numel, itemsize, out, out_cap, cap, threads)

    def apply(self, part: int, numel: int, itemsize: int, changed: int, dst: int, threads: int = 1) -> None:
        """Write one part's sparse encoding at ``part`` into the contiguous ``dst``, its
        blocks spread over up to ``threads`` threads."""
        self._apply(part, numel, itemsize, changed, dst, threads)

    def sample(self, cur: int, ref: int, numel: int, itemsize: int, runs: int, run: int) -> int:
        """Elements of ``itemsize`` bytes that differ between ``cur`` and ``ref`` in ``runs``
        evenly spaced runs of ``run`` elements of the ``numel``."""
        return self._sample(cur, ref, numel, itemsize, runs, run)

    def read_floor(self, a: int, b: int, nbytes: int, threads: int = 1) -> int:
        """One read pass over ``nbytes`` at ``a`` and at ``b`` (the diff's physical floor)."""
        return self._floor(a, b, nbytes, threads)


_NAME = "torchrefit_native_delta"
_lock = threading.RLock()
_loaded: dict[Path, Kernels | None] = {}
_building: dict[Path, threading.Thread] = {}


def built_path() -> Path | None:
    """This source's build folder, or None where the kernel cache is off."""
    return _folder(cache_dir())


@functools.lru_cache(maxsize=8)
def _folder(root: Path | None) -> Path | None:
    # looked up on every delta message (``kernels``): made once per cache directory
    return None if root is None else root.parent / "native" / f"delta-{_key()}"


@functools.cache
def _key() -> str:
    made_of = (SOURCE, os.environ.get("CXX", "c++"), platform.machine(), platform.system())
    return hashlib.sha256("\n".join(made_of).encode()).hexdigest()[:24]


def _library(where: Path) -> Path:
    return where / f"{_NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the library now (about a second) and return the file."""
    where = built_path()
    out = compile_library(where, f"{_NAME}.so", SOURCE, ["-O3"], verbose=verbose)
    with _lock:
        _loaded.pop(where, None)
    return out


def _load(where: Path) -> Kernels | None:
    path = _library(where)
    if not path.is_file():
        return None
    try:
        return Kernels(ctypes.CDLL(str(path)))
    except OSError as e:  # a broken build: the torch ops run instead
        _log.warning("torchrefit: the native delta kernels at %s could not be loaded (%s)", path, e)
        return None


def kernels() -> Kernels | None:
    """The loaded kernels, or None: ``settings.native_delta`` off, no kernel cache, not
    built yet (the first call in a process then starts a build on a thread of its own; a
    call after it finished loads it), or the build failed. Cheap once loaded: a look-up."""
    if not settings.current().native_delta:
        return None
    where = built_path()
    if where is None:
        return None
    got = _loaded.get(where)
    if got is not None:
        return got
    with _lock:
        if where not in _loaded:  # the first ask in this process
            got = _loaded[where] = _load(where)
            if got is None:
                _building[where] = threading.Thread(target=_build_quietly, args=(where,), daemon=True,
                                                    name="torchrefit-delta-build")
                _building[where].start()
            return got
        thread = _building.get(where)
        if thread is not None and not thread.is_alive():  # finished: load it, once
            del _building[where]
            _loaded[where] = _load(where)
        return _loaded[where]


def _build_quietly(where: Path) -> None:
    try:
        build()
        _log.info("torchrefit: native delta kernels built into %s", where)
    except Exception as e:  # noqa: BLE001 (no compiler, a read-only cache: the torch ops stay)
        _log.info("torchrefit: the native delta kernels could not be built (%s); delta refits use "
                  "torch ops", e)


def wait(timeout: float = 120.0) -> Kernels | None:
    """The kernels, built now where they are not (or the build :func:`kernels` started
    awaited); None where ``settings.native_delta`` is off, the cache is off or the build
    failed. For tests and benchmarks, which must know which path they measure."""
    where = built_path()
    if not settings.current().native_delta or where is None:
        return None
    kernels()
    with _lock:
        thread = _building.get(where)
    if thread is not None:
        thread.join(timeout)
    with _lock:
        _building.pop(where, None)
        if _loaded.get(where) is None:
            _loaded[where] = _load(where)
        if _loaded[where] is None:
            try:
                build()
            except Exception as e:  # noqa: BLE001
                _log.info("torchrefit: the native delta kernels could not be built (%s)", e)
                return None
            _loaded[where] = _load(where)
        return _loaded[where]
