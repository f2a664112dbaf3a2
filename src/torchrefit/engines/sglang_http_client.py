"""Trainer rank 0's client of an SGLang HTTP server that runs torchrefit's weight loader
(``engines.sglang_http``, whose docstring describes the route): each torchrefit command
goes to every TP worker through SGLang's own ``/update_weights_from_tensor``, inside a
weight-update window (``/begin_weight_update``, ``/end_weight_update``), and the version
through ``/update_weight_version``. No SGLang import: the trainer needs none."""

from __future__ import annotations

import base64
import json
import pickle
import urllib.error
import urllib.request

import torch

__all__ = ["LOADER", "HTTPClient"]

#: the value of the HTTP server's ``--custom-weight-loader`` this client needs
LOADER = "torchrefit.engines.sglang_http.command_loader"
_PREFIX = "torchrefit:"
#: commands the trainer sends inside a weight-update window it opened itself
_IN_WINDOW = ("update", "commit")


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
