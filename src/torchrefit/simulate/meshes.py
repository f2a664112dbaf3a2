"""Parallel layouts written compactly (``tp8pp4``, ``pp16ep64``, ``tp4@512:1024``) and
where each rank sits in them.

Grammar: any of ``tpN``, ``ppN``, ``epN``, ``etpN`` (expert tensor parallel) and
``dpN`` (a check: data parallel is what the ranks leave), in any order, optionally
separated by ``x``, ``-``, ``_``, ``,`` or spaces, then optionally ``@START:END``
(half-open rank range; default: the whole world). Unnamed sizes are 1, except
expert tensor parallel: ``etp`` defaults to 1 where ``ep`` is given (experts whole,
as inference engines and DeepSeek-style training run them) and to ``tp`` otherwise
(Megatron-core's default).

Rank order is Megatron-core's: TP fastest, then DP, then PP; for experts,
expert-TP fastest, then EP, then expert-DP, then PP. So ``tp8ep8`` over 1024 ranks
is 128 engines of 8 consecutive ranks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Mesh", "Coords", "parse_mesh", "min_ranks"]

_TOKEN = re.compile(r"(etp|tp|pp|ep|dp)(\d+)")
_SEPARATORS = re.compile(r"[\sx_,\-]+")


@dataclass(frozen=True)
class Coords:
    """Where one rank sits: the indices that decide what it holds (not its DP index)."""

    tp: int
    pp: int
    ep: int
    etp: int


@dataclass(frozen=True)
class Mesh:
    """A model's parallel layout over ``ranks`` consecutive ranks from ``offset``.

    The one mesh of the package: toy models (tests, ``torchrefit demo``, benchmarks)
    are built on it and the simulator plans on it. ``etp`` None is Megatron-core's
    default, expert TP = TP; it is resolved at construction, so meshes compare equal
    however they were written.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    ranks: int = 1
    offset: int = 0

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        n = self.ranks
        if min(self.tp, self.pp, self.ep, self.etp) < 1 or n < 1 or self.offset < 0:
            raise ValueError(f"{self}: sizes and the rank range must be positive")
        if n % (self.tp * self.pp) or n % (self.etp * self.ep * self.pp):
            raise ValueError(
                f"{self.describe()}: {n} ranks do not divide into TP x PP = {self.tp * self.pp} "
                f"and expert-TP x EP x PP = {self.etp * self.ep * self.pp}"
            )

    @property
    def end(self) -> int:
        """One past the mesh's last rank."""
        return self.offset + self.ranks

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    def coords(self, rank: int) -> Coords | None:
        """What rank ``rank`` (a world rank) holds, or None outside the mesh."""
        r = rank - self.offset
        if not 0 <= r < self.ranks:
            return None
        per_stage = self.ranks // self.pp
        e = r % per_stage
        return Coords(tp=r % self.tp, pp=r // per_stage, ep=(e // self.etp) % self.ep,
                      etp=e % self.etp)

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica ``rank`` belongs to (it holds what the others do)."""
        return ((rank - self.offset) // self.tp) % self.dp

    def describe(self) -> str:
        parts = [f"TP{self.tp}"]
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.ep > 1 or self.etp != self.tp:
            parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        parts.append(f"DP{self.dp}")
        return " ".join(parts) + f" on ranks {self.offset}-{self.end - 1}"


def _sizes(text: str, body: str) -> dict[str, int]:
    """The sizes a layout names, with the defaults filled in (``dp`` only where named)."""
    sizes: dict[str, int] = {}
    rest = _SEPARATORS.sub("", body)
    pos = 0
    for m in _TOKEN.finditer(rest):
        if m.start() != pos or m.group(1) in sizes:
            break
        sizes[m.group(1)] = int(m.group(2))
        pos = m.end()
    if pos != len(rest):
        raise ValueError(f"layout {text!r}: cannot read {rest[pos:]!r}; write e.g. 'tp8pp4', "
                         "'pp16ep64', 'tp4ep8etp1@512:1024'")
    tp, ep = sizes.get("tp", 1), sizes.get("ep", 1)
    sizes.update(tp=tp, pp=sizes.get("pp", 1), ep=ep, etp=sizes.get("etp", 1 if "ep" in sizes else tp))
    return sizes


def min_ranks(text: str) -> int:
    """The fewest ranks a layout (without ``@``) fits: its model-parallel size times ``dp``."""
    s = _sizes(text, text.strip().lower().partition("@")[0])
    dense, experts = s["tp"] * s["pp"], s["etp"] * s["ep"] * s["pp"]
    return dense * experts // math.gcd(dense, experts) * s.get("dp", 1)


def parse_mesh(text: str, world: int) -> Mesh:
    """``"tp8pp4"`` -> Mesh(tp=8, pp=4, ranks=world); raises ValueError saying why not."""
    body, _, where = text.strip().lower().partition("@")
    start, end = _range(where, world, text)
    sizes = _sizes(text, body)
    try:
        mesh = Mesh(sizes["tp"], sizes["pp"], sizes["ep"], sizes["etp"], end - start, start)
    except ValueError as e:
        raise ValueError(f"layout {text!r}: {e}") from None
    if "dp" in sizes and sizes["dp"] != mesh.dp:
        raise ValueError(f"layout {text!r}: DP is {mesh.dp} over {mesh.ranks} ranks, not {sizes['dp']}")
    return mesh


def _range(where: str, world: int, text: str) -> tuple[int, int]:
    if not where:
        return 0, world
    a, sep, b = where.partition(":")
    try:
        start, end = int(a), int(b) if sep else world
    except ValueError:
        raise ValueError(f"layout {text!r}: the rank range must read @START:END") from None
    if not 0 <= start < end <= world:
        raise ValueError(f"layout {text!r}: ranks {start}:{end} are not inside a world of {world}")
    return start, end
