"""torchrefit: refit model weights from a trainer into an inference model, across layouts.

    import torchrefit as tr
    r = tr.Refitter(src_model, dst_model)   # collective: describe, gather, plan
    report = r.refit()                      # collective: move the newest weights
"""

from . import layout, maps
from .connect import Connection, connect
from .errors import (
    ConnectError,
    LayoutError,
    PlanError,
    RefitError,
    TransportError,
    VerificationError,
)
from .layout import Box, Explicit, Piece, TensorSpec, shard_pieces
from .layout.sink import load_weights_sink
from .refitter import DEFAULT_STAGING_BYTES, RefitReport, Refitter, clear_caches, swap_model_weights
from .transport import Transport, get_transport, register_transport, transport_names
from .versions import weight_version

__version__ = "0.1.0"

__all__ = [
    "Refitter", "RefitReport", "swap_model_weights", "clear_caches", "DEFAULT_STAGING_BYTES",
    "RefitError", "LayoutError", "PlanError", "TransportError", "VerificationError",
    "Box", "Piece", "TensorSpec", "Explicit", "shard_pieces", "layout", "maps",
    "Transport", "get_transport", "register_transport", "transport_names", "__version__",
    "connect", "Connection", "ConnectError", "weight_version", "load_weights_sink",
]
