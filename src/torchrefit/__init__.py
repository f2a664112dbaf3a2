"""torchrefit: refit model weights from a trainer into an inference model, across layouts.

    import torchrefit as tr
    r = tr.Refitter(src_model, dst_model)   # collective: describe, gather, plan
    report = r.refit()                      # collective: move the newest weights

The names below are the public API (the README's API section lists the same ones);
everything else lives in subpackages: ``torchrefit.layout`` (describing what a rank
holds), ``torchrefit.maps`` (name maps), ``torchrefit.plan`` (pure planning),
``torchrefit.execute`` and ``torchrefit.transport`` (moving bytes). torchrefit logs
through the ``torchrefit`` :mod:`logging` logger and prints nothing unless the
application configures logging.
"""

import logging as _logging

from . import maps
from . import settings as settings  # tr.settings: every tunable, documented there
from .connect import Connection, connect
from .errors import (
    ConnectError,
    LayoutError,
    PlanError,
    RefitError,
    TransportError,
    VerificationError,
)
from .fleet import Fleet, FleetReport, JoinRefused, join
from .layout import Box, Explicit, Piece, TensorSpec, shard_pieces
from .layout.sink import load_weights_sink
from .layout.vllm_tp import vllm_tp_layout
from .plan.cache import PlanCache
from .refitter import RefitReport, Refitter
from .stage_commit import CommitReport, StageHandle, StageReport
from .swap import clear_caches, swap_model_weights
from .transport import Transport, register_transport, transport_names
from .versions import weight_version

__version__ = "0.1.0"

__all__ = [
    # refitting
    "Refitter", "RefitReport", "swap_model_weights", "clear_caches", "PlanCache",
    # refit while the engine serves: stage, then commit
    "StageHandle", "StageReport", "CommitReport",
    # describing what a rank holds
    "Explicit", "TensorSpec", "Box", "Piece", "shard_pieces", "vllm_tp_layout",
    # name maps
    "maps",
    # transports
    "Transport", "register_transport", "transport_names",
    # errors
    "RefitError", "LayoutError", "PlanError", "TransportError", "VerificationError",
    "ConnectError",
    # separately launched trainer and engine jobs; weight versions; engine load_weights
    "connect", "Connection", "weight_version", "load_weights_sink",
    # a fleet of engine replicas that come and go
    "Fleet", "join", "FleetReport", "JoinRefused",
    # every tunable: tr.settings.configure(...), tr.settings.overridden(...)
    "settings",
]

# A library adds no handler of its own: without this, Python's last-resort handler would
# print the package's warnings to stderr in applications that never configured logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())
