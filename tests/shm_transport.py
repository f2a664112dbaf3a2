"""Two one-sided transports over CPU shared memory, for testing the one-sided protocol
(``execute.one_sided``) on CPU: ``shm-pull`` (receivers copy out of the senders'
shared storages, as ``ipc`` does on GPUs) and ``shm-push`` (senders write into the
receivers' shared storages, as ``nixl`` does). Tensors must live in shared memory
(``model.share_memory()``). Each rank logs the protocol calls it made, in order,
so tests can check the cross-process ordering without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrefit.layout._types import dtype_from_name, dtype_name
from torchrefit.transport.base import Availability, register_transport
from torchrefit.transport.one_sided import OneSidedTransport, Table

LOG: list[str] = []  # this process's protocol calls


class _Shm(OneSidedTransport):
    preference = -10  # never chosen by "auto"

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    def expose(self, tensors: Sequence[torch.Tensor]) -> object:
        return tuple((t.untyped_storage()._share_filename_cpu_(), t.storage_offset(), tuple(t.shape),
                      tuple(t.stride()), dtype_name(t.dtype)) for t in tensors)

    def attach(self, peer: int, table: Table) -> tuple:
        exposed, regions = table
        LOG.append(f"attach:{peer}")
        tensors = [torch.empty(0, dtype=dtype_from_name(dtype)).set_(
            torch.UntypedStorage._new_shared_filename_cpu(*handle), offset, shape, stride)
            for handle, offset, shape, stride, dtype in exposed]
        return tuple(tensors[i][box.slices()] for i, box in regions)

    def ready(self) -> bytes:
        LOG.append("ready")
        return b"token"

    def wait_ready(self, peer: int, token: bytes) -> None:
        assert token == b"token"
        LOG.append(f"wait_ready:{peer}")

    def done(self) -> bytes:
        LOG.append("done")
        return b"done"

    def wait_done(self, peer: int, token: bytes) -> None:
        assert token == b"done"
        LOG.append(f"wait_done:{peer}")


@register_transport
class ShmPull(_Shm):
    name = "shm-pull"
    pull = True


@register_transport
class ShmPush(_Shm):
    name = "shm-push"
    pull = False

    def write(self, peer: int, local: Sequence[torch.Tensor], remote: tuple) -> None:
        LOG.append(f"write:{peer}")
        for dst, src in zip(remote, local):
            dst.copy_(src)
