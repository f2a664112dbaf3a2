"""torchrefit's SGLang backend reached through SGLang's HTTP server (``sglang.launch_server``).

The HTTP server has no route to the scheduler methods :mod:`.sglang` adds, but its own
``/update_weights_from_tensor`` route calls, in every TP worker, a function named by the
server's ``--custom-weight-loader`` with the model and the tensors it was sent. This
module is both ends of that route:

* engine side: :func:`command_loader`, the custom weight loader
  (``--custom-weight-loader torchrefit.engines.sglang_http.command_loader``). What it is
  sent is one command (a JSON name on a one-byte tensor): join the trainer's link, take
  an update, stage, commit, close; the bytes of the update move over torchrefit's link,
  shard to shard, as with the in-process ``sglang.Engine``;
* trainer side: :class:`HTTPClient` (``engines.sglang_http_client``, which imports no
  SGLang; re-exported here), trainer rank 0's client (``init_sender(info, model,
  "http://host:30000")``): SGLang's own ``/begin_weight_update``,
  ``/update_weights_from_tensor`` (which checks that the weight-update window is open and
  flushes the cache after the update), ``/end_weight_update`` and
  ``/update_weight_version``.

SGLang's scheduler does not catch an exception a custom weight loader raises (it would
stop the engine), so :func:`command_loader` never raises: what fails inside the update
is told to every rank of both jobs over torchrefit's link, the trainer's ranks raise, and
rank 0 records no weight version. A command the engine refuses before it reaches the
link (no link initialized on this engine) is only in the engine's log; the trainer's
ranks then raise at the link's timeout.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from torch import nn

from .sglang import SGLangWorkerInfo, _Receiver
from .sglang_http_client import _PREFIX, LOADER, HTTPClient

__all__ = ["LOADER", "HTTPClient", "command_loader"]

_log = logging.getLogger(__name__)

_RECEIVERS: dict[int, _Receiver] = {}  # one per live model (one per TP worker process)


# ------------------------------------------------------------------- engine side
def command_loader(model: nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader: run each torchrefit command it is handed on this
    TP worker. Never raises (see the module's docstring)."""
    for name, _ in named_tensors:
        if not name.startswith(_PREFIX):
            _log.error("torchrefit: %s is not a torchrefit command; ignored", name[:80])
            continue
        command = json.loads(name[len(_PREFIX):])
        try:
            _run(model, command)
        except Exception:
            _log.exception("torchrefit: SGLang HTTP command %r failed", command.get("op"))


def _run(model: nn.Module, command: dict) -> None:
    op = command["op"]
    if op in ("init", "close"):
        old = _RECEIVERS.pop(id(model), None)
        if old is not None:  # a trainer's earlier link (one whose peer died, say)
            old.close()
        if op == "init":
            _RECEIVERS[id(model)] = _Receiver(model, model.config,
                                              SGLangWorkerInfo(**json.loads(command["info"])))
        return
    receiver = _RECEIVERS.get(id(model))
    if receiver is None:
        raise RuntimeError(f"torchrefit: {op} before any torchrefit init on this engine")
    if op == "update":
        receiver.update(None, command["update"])
    elif op == "stage":
        receiver.stage(command["update"])
    elif op == "commit":
        receiver.commit(None, command["update"])
    else:
        raise ValueError(f"torchrefit: unknown command {op!r}")
