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
* trainer side: :class:`HTTPClient`, trainer rank 0's client (``init_sender(info, model,
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

import base64
import json
import logging
import pickle
import urllib.error
import urllib.request
from typing import Any

import torch
from torch import nn

from .sglang import SGLangWorkerInfo, _Receiver

__all__ = ["LOADER", "HTTPClient", "command_loader"]

_log = logging.getLogger(__name__)

#: the value of the HTTP server's ``--custom-weight-loader`` this client needs
LOADER = "torchrefit.engines.sglang_http.command_loader"
_PREFIX = "torchrefit:"
_RECEIVERS: dict[int, _Receiver] = {}  # one per live model (one per TP worker process)
#: commands the trainer sends inside a weight-update window it opened itself
_IN_WINDOW = ("update", "commit")


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


# ------------------------------------------------------------------ trainer side
class HTTPClient:
    """Trainer rank 0's way to an SGLang HTTP server at ``url`` (``"http://host:30000"``),
    which must run with ``--custom-weight-loader`` :data:`LOADER`. ``timeout``: seconds
    one HTTP call may take (an update's call lasts as long as its transfer).
    ``api_key``: the server's ``--admin-api-key`` or ``--api-key``, if it has one."""

    def __init__(self, url: str, timeout: float = 3600.0, api_key: str | None = None) -> None:
        self.url, self.timeout, self.api_key = url.rstrip("/"), timeout, api_key
        self._tp_size: int | None = None

    def rpc(self, method: str, **kw) -> None:
        """One torchrefit command on every TP worker; outside an update, inside a
        weight-update window of its own."""
        op = method.removeprefix("torchrefit_")
        if op in _IN_WINDOW:
            self._command(op, kw, flush=True)
            return
        self.begin()
        try:
            self._command(op, kw, flush=False)
        finally:
            self.end()

    def begin(self) -> None:
        self._post("/begin_weight_update", {})

    def end(self) -> None:
        self._post("/end_weight_update", {})

    def set_weight_version(self, version: str) -> None:
        self._post("/update_weight_version", {"new_version": version,
                                              "abort_all_requests": False})

    def _command(self, op: str, kw: dict, flush: bool) -> None:
        name = _PREFIX + json.dumps(dict(kw, op=op))
        payload = base64.b64encode(pickle.dumps([(name, torch.zeros(1, dtype=torch.uint8))]))
        self._post("/update_weights_from_tensor", {
            "serialized_named_tensors": [payload.decode()] * self.tp_size(),
            "load_format": LOADER, "flush_cache": flush})

    def tp_size(self) -> int:
        """The server's TP size (its ``/server_info``), checked once to run :data:`LOADER`."""
        if self._tp_size is None:
            info = self._request("GET", "/server_info", None)
            if LOADER not in (info.get("custom_weight_loader") or []):
                raise RuntimeError(f"the SGLang server at {self.url} does not run torchrefit's "
                                   f"weight loader: launch it with --custom-weight-loader "
                                   f"{LOADER}")
            self._tp_size = int(info["tp_size"])
        return self._tp_size

    def _post(self, route: str, body: dict) -> dict:
        got = self._request("POST", route, body)
        if isinstance(got, dict) and got.get("success") is False:
            raise RuntimeError(f"SGLang's {route} failed: {got.get('message')}")
        return got

    def _request(self, method: str, route: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            raise RuntimeError(f"SGLang's {route} failed (HTTP {e.code}): "
                               f"{_message(text)}") from None
        return json.loads(text) if text.strip().startswith(("{", "[")) else {"text": text}


def _message(text: str) -> str:
    try:
        return str(json.loads(text).get("message", text))
    except (ValueError, AttributeError):
        return text.strip()[:500]
