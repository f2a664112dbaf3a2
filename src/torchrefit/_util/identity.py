"""Object identity for per-tensor and per-module memos, without ``id()``'s audit event.

``id()`` raises the audit event ``builtins.id`` on every call, so each Python audit hook
in the process runs on it. filelock 4 adds one on Python >= 3.12, and megatron-core
imports filelock: in such a process an ``id()`` cost 0.27 us instead of 0.03 us (2-core
CPU), and one Refitter and two refits of a qwen3-shaped megatron-core pair (8 layers)
made tens of thousands of them (module walks, parameter and holder memos, roster
decoding), now a dozen (``tests/test_audit_hooks.py`` bounds them). A tensor's own ``__hash__`` is ``id(self)``
in Python, so keying a dict by the tensor pays the same.

``object.__hash__`` is the object's address rotated by four bits (CPython), so it is as
unique among live objects as ``id()``; it raises no event (0.05-0.06 us with or without
hooks). Keys are only compared while their objects are alive, as with ``id()``.
"""

from __future__ import annotations

__all__ = ["identity"]

#: ``identity(obj) -> int``: equal for two live objects only if they are the same object
identity = object.__hash__
