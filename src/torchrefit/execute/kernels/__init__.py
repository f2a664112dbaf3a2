"""torchrefit's own device kernels, each compiled or JIT-built at first use:

* ``copy_runs``: one CUDA kernel (NVRTC) that copies many byte runs in one launch;
* ``elementwise_copies``: large copies as elementwise kernels on wider views of the bytes;
* ``delta_blocks``: delta refits' diff, encode and apply (Triton);
* ``fp8_blocks``: block FP8 quantization of many regions in one launch (Triton);
* ``region_checksums``: ``verify()``'s checksum of many regions in one launch (Triton);
* ``image_cache``: compiled kernel images kept on disk for later processes.
"""

import os
from collections.abc import Callable


def triton_runs(device_type: str, load: Callable[[], object]) -> bool:
    """Whether Triton kernels run on this device type: CUDA, or any device under Triton's
    interpreter (``TRITON_INTERPRET=1``, tests), and ``load()`` (which imports the
    kernels) succeeds, so Triton is installed."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        load()
    except Exception:  # no triton
        return False
    return True
