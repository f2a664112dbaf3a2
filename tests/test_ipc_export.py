"""What the ipc transport exports (``transport.ipc.export_segments``), on CPU.

A sender exports one handle per allocation segment, and the receiver opens each as
one storage spanning from the segment's base to the last tensor in it. Under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` torch shares a storage as the
mapped pieces (2 or 20 MB) that hold it, so a handle opens those pieces only: a
segment grown past them would map addresses the handle never shared. torch's
``_share_cuda_`` and the allocator's snapshot are replaced by fakes over host
memory (numpy-backed storages, back to back as the allocator carves them); the
oracle is the pieces each fake handle shares.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_copy_runs import storages_back_to_back

from torchrefit.transport import ipc

PIECE = 256 * 4  # bytes of one mapped piece in the fake segment


def _fake_torch(monkeypatch: pytest.MonkeyPatch, buf: np.ndarray, expandable: bool) -> dict[bytes, tuple]:
    """Fakes of the snapshot (one segment: ``buf``) and of ``_share_cuda_``; returns
    what each handle shares, (first byte, one past the last), as the oracle."""
    base = buf.ctypes.data
    shared: dict[bytes, tuple[int, int]] = {}

    def share(storage: torch.UntypedStorage) -> tuple:
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if expandable:  # the pieces that hold the storage
            first, last = (lo - base) // PIECE, (hi - base + PIECE - 1) // PIECE
            handle, start, end = b"\x02e" + f"{first}-{last}".encode(), base + first * PIECE, base + last * PIECE
        else:  # the whole cudaMalloc'd segment
            handle, start, end = b"\x02c" + b"segment", base, base + buf.nbytes
        shared[handle] = (start, end)
        return (0, handle, storage.nbytes(), lo - start, b"ref", 0, b"event", False)

    monkeypatch.setattr(ipc, "_segments", lambda: ([base], [buf.nbytes]))
    monkeypatch.setattr(ipc, "_share", share)
    return shared


@pytest.mark.parametrize("expandable", [False, True])
def test_segments_open_only_what_their_handle_shares(monkeypatch: pytest.MonkeyPatch, expandable: bool) -> None:
    buf = np.zeros(1000, dtype=np.float32)
    # pieces of 256 floats: t0 in the first, t1 spanning the first two, t2 and t3 in
    # the second, t4 from the second to the fourth; t5 a view of t3's storage
    tensors = storages_back_to_back(buf, [100, 300, 60, 50, 490])
    tensors.append(tensors[3][10:20])
    shared = _fake_torch(monkeypatch, buf, expandable)
    segments, exported = ipc.export_segments(tensors)
    for t, e in zip(tensors, exported):
        seg = segments[e.segment]
        start, end = shared[seg.handle]
        opened = (start, start + seg.nbytes)
        assert seg.share[2:4] == (seg.nbytes, 0)  # opened from the shared base
        assert opened[1] <= end, f"segment {e.segment} opens {opened[1] - end} bytes its handle never shared"
        assert start + e.offset == t.data_ptr() and e.offset + t.nbytes <= seg.nbytes
    if expandable:  # one segment per set of pieces: {0}, {0,1}, {1} (t2, t3, t5), {1,2,3}
        assert len(segments) == 4
        assert exported[2].segment == exported[3].segment == exported[5].segment
    else:  # one handle for the whole segment
        assert len(segments) == 1


@pytest.mark.parametrize("kind", [b"c", b"e"])
def test_a_segment_that_cannot_be_opened_names_the_ranks(monkeypatch: pytest.MonkeyPatch, kind: bytes) -> None:
    """torch opens an expandable segment's pieces through pidfd_getfd, which a container
    may forbid: the receiver raises a TransportError naming both ranks, with what to
    change where the memory is of expandable segments."""
    from torchrefit.errors import TransportError

    def refuse(*share):
        raise RuntimeError("pidfd_getfd: Operation not permitted")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", refuse, raising=False)
    receiver = object.__new__(ipc.IpcTransport)  # no GPU here: only what _open reads
    receiver._opened, receiver.rank = {}, 1
    segment = ipc.Segment((0, b"\x02" + kind + b"handle", 4096, 0, b"ref", 0, b"event", False), 4096)
    with pytest.raises(TransportError) as e:
        receiver._open(0, segment)
    assert "rank 1 cannot open 4096 bytes of rank 0's GPU memory" in str(e.value)
    assert "Operation not permitted" in str(e.value)
    assert ("expandable_segments:False" in str(e.value)) == (kind == b"e")
