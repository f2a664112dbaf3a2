"""``watch="every"``'s per-refit checks as one C++ call each, where the user built it.

Before every refit a rank checks that each tensor it was described with is still the
one its module holds (``layout.binding.Binding.changed``) and that each compiled view
still has its storage, offset, sizes, strides and address
(``execute.program.Program.storage_moved``). In Python that is one C call per tensor
and check, which for an MoE model of thousands of tensors is a sizeable share of a
refit's time next to its copies. Here the same two answers come from one call each, a
loop over handles taken when compiling.

It is optional: ``torchrefit native build`` (or :func:`build`; a Refitter watching many
tensors starts one in the background, ``_native.build``) compiles it once per
environment, with the C++ compiler and torch's headers, into the cache directory
(``_util.cache_dir``'s root, ``.../torchrefit/native``), filed under a hash of the
source, torch's and Python's versions; :func:`module` imports it when it is there and
returns None otherwise or with ``settings.native_watch`` off. Without it the Python
checks run, with the same answers.

After a full look found nothing replaced, the holders' check looks again only once one of
their dicts changed: on Python 3.12+ a dict watcher (``PyDict_Watch``) counts changes, so
the check is one comparison while the model keeps its tensors; before 3.12 it compares
each dict's version tag (PEP 509), one load a dict instead of a look-up. A trainer that
re-registers parameters every step, as FSDP2 does, gets the full look each time.

From ``COLLAPSE_MIN`` views on, the views check's first answer also starts a thread that
asks the kernel to make the memory holding those tensors' metadata (their TensorImpls
and StorageImpls, thousands of small objects on thousands of 4 KiB pages) huge pages:
the check then no longer walks page tables per object.

Each native answer is a fast path only: True means nothing changed (the same conditions
as ``Tensor.is_set_to`` plus the address and the dtype, and the same identity as the
Python binding check); False sends the caller to the Python check, which finds what changed and
raises or recompiles as it does without this module. So a wrong "changed" costs time, never a byte.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import platform
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from .. import settings
from .._util.cache_dir import cache_dir
from .compile import compile_library

__all__ = ["COLLAPSE_MIN", "SOURCE", "build", "built_path", "module",
           "views_check", "holders_check"]

#: views from which the memory of their metadata is made huge pages (:func:`views_check`):
#: a few hundred objects fit the TLB's 4 KiB entries anyway
COLLAPSE_MIN = 512
_NAME = "torchrefit_native_watch"
_log = logging.getLogger("torchrefit")

SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older kernels answer EINVAL
#endif
#endif

// Compiled views of a program: unchanged() is true iff every tensor still has the
// storage, offset, sizes and strides of its alias taken when compiling
// (Tensor.is_set_to), its dtype, and its storage's data at the address it had then (a
// storage resized in place keeps its identity, not its address): so its own data
// address too.
struct Views {
  std::vector<at::Tensor> watched, refs;  // refs keep each storage as compiled alive: its
                                          // identity cannot pass to a new storage, and
                                          // reading it (below) is always safe
  std::vector<const c10::StorageImpl*> storages;
  std::vector<int64_t> offsets, shapes;  // shapes: each tensor's sizes then strides, flat
  std::vector<size_t> starts;            // where each tensor's sizes begin in shapes; one more at the end
  std::vector<intptr_t> datas;           // each storage's data address as compiled
  std::vector<caffe2::TypeMeta> dtypes;
  std::vector<char> readable;  // when compiling, its storage could be read and it was its ref
  std::vector<uintptr_t> regions;  // the 2 MiB regions holding the TensorImpls and StorageImpls
  mutable bool collapse_later;     // collapse() on a thread of its own at the first unchanged()

  Views(std::vector<at::Tensor> w, std::vector<at::Tensor> r, bool collapse)
      : watched(std::move(w)), refs(std::move(r)), collapse_later(collapse) {
    TORCH_CHECK(watched.size() == refs.size(), "torchrefit: watched and refs differ in length");
    for (size_t i = 0; i < watched.size(); ++i) {
      const auto* t = watched[i].unsafeGetTensorImpl();
      const auto* ref = refs[i].unsafeGetTensorImpl();
      bool ok = false;
      const c10::StorageImpl* storage = nullptr;
      intptr_t data = 0;
      try {  // as compiled, the tensor is its ref (is_set_to); a storage that cannot be read: never "unchanged"
        if (t->has_storage() && ref->has_storage()) {
          storage = ref->storage().unsafeGetStorageImpl();
          data = reinterpret_cast<intptr_t>(storage->data());
          ok = t->storage().unsafeGetStorageImpl() == storage;
        }
      } catch (const std::exception&) {
      }
      storages.push_back(ok ? storage : nullptr);
      offsets.push_back(ok ? ref->storage_offset() : 0);
      starts.push_back(shapes.size());
      if (ok) {
        shapes.insert(shapes.end(), ref->sizes().begin(), ref->sizes().end());
        shapes.insert(shapes.end(), ref->strides().begin(), ref->strides().end());
      }
      datas.push_back(data);
      dtypes.push_back(t->dtype());
      readable.push_back(ok && t->sizes() == ref->sizes() && t->strides() == ref->strides()
                         && t->storage_offset() == ref->storage_offset());
    }
    starts.push_back(shapes.size());
    for (size_t i = 0; i < watched.size(); ++i) {
      regions.push_back(reinterpret_cast<uintptr_t>(watched[i].unsafeGetTensorImpl()) / kHuge);
      if (storages[i] != nullptr) regions.push_back(reinterpret_cast<uintptr_t>(storages[i]) / kHuge);
    }
    std::sort(regions.begin(), regions.end());
    regions.erase(std::unique(regions.begin(), regions.end()), regions.end());
  }

  static constexpr uintptr_t kHuge = uintptr_t(1) << 21;  // a huge page: 2 MiB

  // Each 2 MiB-aligned region of memory holding a watched tensor's TensorImpl or its
  // storage's StorageImpl, made one huge page (MADV_COLLAPSE; a region the kernel cannot,
  // e.g. one not wholly mapped, stays as it is). These few thousand small objects lie on
  // thousands of 4 KiB pages, more than the TLB holds: unchanged() then pays a page walk
  // per object, warm or cold. Nothing moves: the same addresses, other page tables.
  // Returns how many regions were made huge pages.
  static size_t collapse_regions(const std::vector<uintptr_t>& rs) {
    size_t done = 0;
#if defined(__linux__)
    for (const uintptr_t r : rs) {
      if (madvise(reinterpret_cast<void*>(r * kHuge), kHuge, MADV_COLLAPSE) == 0) ++done;
    }
#endif
    return done;
  }

  // (regions, regions made huge pages), now, on the calling thread
  std::pair<size_t, size_t> collapse() const { return {regions.size(), collapse_regions(regions)}; }

  // The first unchanged() (the second refit's; the first refit compiled) starts collapse()
  // on a detached thread with its own copy of the regions, and returns: collapsing takes
  // tens of milliseconds, which no refit waits for; until it is done the answers are
  // the same, only slower.
  void start_collapse() const {
    collapse_later = false;
    try {
      std::thread([rs = regions] { collapse_regions(rs); }).detach();
    } catch (const std::exception&) {  // no thread to be had: the pages stay as they are
    }
  }

  bool unchanged() const {
    if (collapse_later) start_collapse();
    // Two passes, each a short independent load per tensor, rather than one pass whose
    // every tensor is a chain (TensorImpl, then its StorageImpl): right after the host
    // waited for the GPU, as refits are timed, these objects are out of the core's
    // caches, and short independent loads keep many misses in flight at once (about half
    // the time of the chained pass for a qwen3-shaped toy's 4182 views, caches cold).
    const size_t n = watched.size();
    try {
      for (size_t i = 0; i < n; ++i) {  // each storage as compiled: alive (refs), so readable
        if (!readable[i] || reinterpret_cast<intptr_t>(storages[i]->data()) != datas[i]) return false;
      }
      for (size_t i = 0; i < n; ++i) {  // each tensor still views that storage as compiled
        const auto* a = watched[i].unsafeGetTensorImpl();
        if (!a->has_storage() || a->storage().unsafeGetStorageImpl() != storages[i]
            || a->storage_offset() != offsets[i] || a->dtype() != dtypes[i]) return false;
        const auto sizes = a->sizes();
        const size_t dim = sizes.size();
        if (starts[i] + 2 * dim != starts[i + 1]) return false;
        const c10::IntArrayRef was(shapes.data() + starts[i], dim), was_strides(shapes.data() + starts[i] + dim, dim);
        if (sizes != was || a->strides() != was_strides) return false;
      }
    } catch (const std::exception&) {  // the Python check decides (and raises, if it must)
      return false;
    }
    return true;
  }
};

#if PY_VERSION_HEX >= 0x030C0000
// Python 3.12+: a dict watcher counts every change made to a watched dict (set, delete,
// clear, update, ...; CPython notifies each, as its own specializations rely on).
// Holders whose dicts saw no change since their last full look are unchanged without
// looking again: one comparison per refit while nothing replaces a parameter. (Right
// after the host waited for the GPU, as refits are timed, a full look at thousands of
// dicts, names and tables finds them out of the core's caches.)
static uint64_t dict_changes = 0;
static int watcher_id = -2;  // -2: not asked for yet; -1: none to be had (all taken)

static int count_change(PyDict_WatchEvent, PyObject*, PyObject*, PyObject*) {
  ++dict_changes;
  return 0;
}

static bool can_watch() {
  if (watcher_id == -2) {
    watcher_id = PyDict_AddWatcher(count_change);
    if (watcher_id < 0) {
      PyErr_Clear();
      watcher_id = -1;
    }
  }
  return watcher_id >= 0;
}
#endif

// A model's holders of its described tensors: unchanged() is true iff every dict still
// maps its name to the very object held (module._parameters / _buffers are dicts).
struct Holders {
  std::vector<pybind11::object> dicts, names, held;
  bool watched = false;           // changes to its dicts are seen without looking them up
  mutable bool seen_any = false;  // a full look found them unchanged ...
#if PY_VERSION_HEX >= 0x030C0000
  mutable uint64_t seen_at = 0;   // ... when dict_changes was this
#else
  // ... when each dict had this version: before 3.12 each dict carries a tag that every
  // change to it renews (PEP 509), one load a dict where a look-up is a chain of three
  mutable std::vector<uint64_t> versions;

  static uint64_t version(const pybind11::object& d) {
    return reinterpret_cast<const PyDictObject*>(d.ptr())->ma_version_tag;
  }
#endif

  Holders(std::vector<pybind11::object> d, std::vector<pybind11::object> n, std::vector<pybind11::object> h)
      : dicts(std::move(d)), names(std::move(n)), held(std::move(h)) {
    TORCH_CHECK(dicts.size() == names.size() && names.size() == held.size(),
                "torchrefit: holders differ in length");
    for (const auto& d : dicts) TORCH_CHECK(PyDict_CheckExact(d.ptr()), "torchrefit: a holder is not a dict");
#if PY_VERSION_HEX >= 0x030C0000
    watched = can_watch();
    for (size_t i = 0; watched && i < dicts.size(); ++i) {
      if (PyDict_Watch(watcher_id, dicts[i].ptr()) < 0) {  // never: an exact dict, a valid id
        PyErr_Clear();
        watched = false;
      }
    }
#else
    watched = true;
    versions.resize(dicts.size());
#endif
  }

  bool unchanged() const {
#if PY_VERSION_HEX >= 0x030C0000
    if (watched && seen_any && seen_at == dict_changes) return true;
    const uint64_t now = dict_changes;  // the look below changes no dict
#else
    if (seen_any) {
      size_t i = 0;
      while (i < dicts.size() && version(dicts[i]) == versions[i]) ++i;
      if (i == dicts.size()) return true;
    }
#endif
    for (size_t i = 0; i < dicts.size(); ++i) {
      PyObject* held_now = PyDict_GetItemWithError(dicts[i].ptr(), names[i].ptr());  // borrowed
      if (held_now != held[i].ptr()) {
        PyErr_Clear();
        return false;
      }
    }
    seen_any = true;
#if PY_VERSION_HEX >= 0x030C0000
    seen_at = now;
#else
    for (size_t i = 0; i < dicts.size(); ++i) versions[i] = version(dicts[i]);
#endif
    return true;
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Views>(m, "Views")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, bool>())
      .def("unchanged", &Views::unchanged)
      .def("collapse", &Views::collapse, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_readonly("regions", &Views::regions)
      .def_property_readonly("collapse_pending", [](const Views& v) { return v.collapse_later; });
  pybind11::class_<Holders>(m, "Holders")
      .def(pybind11::init<std::vector<pybind11::object>, std::vector<pybind11::object>,
                          std::vector<pybind11::object>>())
      .def("unchanged", &Holders::unchanged)
      .def_readonly("watched", &Holders::watched);
}
"""

_loaded: dict[Path, ModuleType | None] = {}


def built_path() -> Path | None:
    """Where this environment's build lives (a folder keyed by the source and the torch
    and Python it was built for), or None where the cache is off."""
    root = cache_dir()
    return None if root is None else root.parent / "native" / f"watch-{_key()}"


@functools.cache
def _key() -> str:
    made_of = (SOURCE, torch.__version__, str(torch.version.git_version), sys.version, platform.machine())
    return hashlib.sha256("\n".join(made_of).encode()).hexdigest()[:24]


def build(verbose: bool = False) -> Path:
    """Compile the module for this environment and return the built file: one call of
    the C++ compiler with torch's headers and libraries, as torch's ``cpp_extension``
    would call it, without needing ninja; tens of seconds."""
    from torch.utils.cpp_extension import include_paths, library_paths

    where = built_path()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = ["-O2", f"-DTORCH_EXTENSION_NAME={_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             *(f"-isystem{p}" for p in (*include_paths(), sysconfig.get_paths()["include"]))]
    link = [*(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    out = compile_library(where, f"{_NAME}.so", SOURCE, flags, link, verbose)
    _loaded.pop(where, None)
    return out


def _library(where: Path) -> Path:
    return where / f"{_NAME}.so"


def enabled() -> bool:
    """``settings.native_watch`` (environment: ``TORCHREFIT_NATIVE_WATCH=0`` turns it
    off): False asks for the Python checks only, and for no build in the background."""
    return settings.current().native_watch


def module(fresh: bool = False) -> ModuleType | None:
    """The built module, imported once per process; None where it was not built for this
    environment, cannot be imported, or ``settings.native_watch`` is off. ``fresh``:
    look again where an earlier call found nothing (a build landed since)."""
    if not enabled():
        return None
    where = built_path()
    if where is None:
        return None
    if where not in _loaded or (fresh and _loaded[where] is None):
        _loaded[where] = _import(_library(where))
    return _loaded[where]


def _import(path: Path) -> ModuleType | None:
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(_NAME, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 (a broken build: the Python checks run instead)
        _log.warning("torchrefit: the native watch check at %s could not be loaded (%s); "
                     "using the Python checks", path, e)
        return None
    return mod


def views_check(watched: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...]):
    """A native ``unchanged()`` over compiled views, or None without the module. With
    ``COLLAPSE_MIN`` tensors or more, its first ``unchanged()`` starts a thread that has
    the memory holding their TensorImpls and StorageImpls made huge pages
    (``Views.collapse``): an 8-layer qwen3-shaped model's 4182 views are 8364 objects on
    ~3300 pages of 4 KiB, which fit in 17-19 huge pages of 2 MiB, so the check stops
    missing the TLB on nearly every object."""
    collapse = len(watched) >= COLLAPSE_MIN
    return _made("Views", list(watched), list(refs), collapse)


def holders_check(dicts: list, names: list[str], held: list):
    """A native ``unchanged()`` over a binding's holders (all plain dicts), or None."""
    return _made("Holders", dicts, names, held)


def _made(kind: str, *args):
    mod = module()
    if mod is None:
        return None
    try:
        return getattr(mod, kind)(*args)
    except Exception as e:  # noqa: BLE001 (what it cannot hold, the Python checks check)
        _log.debug("torchrefit: no native %s check here (%s); using the Python one", kind, e)
        return None
