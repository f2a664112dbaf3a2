"""A predicted refit time from a plan's bytes: per rank, per link, on given hardware.

The model: rank ``r`` is GPU ``r % gpus_per_node`` of node ``r // gpus_per_node``
(trainer and engine ranks collocated where they share a rank). A pair of ranks
on one node talks over NVLink, other pairs over the network; each GPU sends and
receives at most ``nvlink_gbs`` over NVLink and ``net_gbs`` over its network
interface at once, in each direction, and copies locally at ``copy_gbs`` (bytes
read plus bytes written, as REFERENCE.md measures HBM copies). A rank takes the
largest of its terms:

* send: bytes it sends within the node / NVLink, and to other nodes / network;
* receive: the same for what it receives;
* link: its busiest single peer link at that link's bandwidth;
* copy: its local copies, read and written, at ``copy_gbs``;

and the refit takes as long as its slowest rank. This is a lower bound: no
per-message latency, no packing or unpacking, no congestion inside the network,
no waiting between rounds, NVLink and network used at once at full rate, and
every rank starting at the same moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from .traffic import Traffic

__all__ = ["Hardware", "RankTime", "Prediction", "predict", "rank_times"]


@dataclass(frozen=True)
class Hardware:
    """Bandwidths per GPU per direction, in GB/s (1e9 bytes per second).

    Defaults: an 8-GPU H100/H200 node (NVLink 4 through NVSwitch: 900 GB/s both
    directions, 450 GB/s each way), one 400 Gb/s network interface per GPU
    (50 GB/s), and a device-to-device copy at 4000 GB/s read plus written (an
    H200's HBM3e copies at about that rate).
    """

    gpus_per_node: int = 8
    nvlink_gbs: float = 450.0
    net_gbs: float = 50.0
    copy_gbs: float = 4000.0

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus per node must be at least 1, not {self.gpus_per_node}")
        for name in ("nvlink_gbs", "net_gbs", "copy_gbs"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_gbs', '')} bandwidth must be positive, "
                                 f"not {getattr(self, name)} GB/s")

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


@dataclass(frozen=True)
class RankTime:
    """One rank's bytes by path and the seconds each term takes."""

    rank: int
    sent_nvlink: int
    sent_net: int
    received_nvlink: int
    received_net: int
    busiest_link: int  # bytes of its largest single peer link
    busiest_link_net: bool  # whether that link crosses nodes
    local: int  # bytes copied locally (each read once and written once)
    send_seconds: float
    receive_seconds: float
    link_seconds: float
    copy_seconds: float
    seconds: float
    bound: str  # the term that sets ``seconds``


@dataclass(frozen=True)
class Prediction:
    """The predicted refit: the slowest rank's time, and what bounds it."""

    hardware: Hardware
    seconds: float
    slowest: RankTime
    bytes_nvlink: int  # all bytes that cross NVLink (within a node)
    bytes_net: int  # all bytes that cross the network

    def line(self) -> str:
        s, h = self.slowest, self.hardware
        return (f"{self.seconds * 1e3:.1f} ms, set by rank {s.rank}'s {s.bound} "
                f"(send {s.send_seconds * 1e3:.1f} ms, receive {s.receive_seconds * 1e3:.1f} ms, "
                f"link {s.link_seconds * 1e3:.1f} ms, copy {s.copy_seconds * 1e3:.1f} ms) on "
                f"{h.gpus_per_node} GPUs a node, NVLink {h.nvlink_gbs:g} GB/s, network "
                f"{h.net_gbs:g} GB/s, copies {h.copy_gbs:g} GB/s per GPU; "
                f"{self.bytes_nvlink / 1e9:.2f} GB over NVLink, {self.bytes_net / 1e9:.2f} GB "
                "over the network")


def predict(moves: Traffic, hw: Hardware | None = None) -> Prediction:
    """The predicted time of a refit whose whole-world traffic is ``moves``."""
    hw = hw or Hardware()
    times = rank_times(moves, hw)
    slowest = max(times, key=lambda t: t.seconds)
    return Prediction(hw, slowest.seconds, slowest, sum(t.sent_nvlink for t in times),
                      sum(t.sent_net for t in times))


def rank_times(moves: Traffic, hw: Hardware) -> list[RankTime]:
    """Every rank's bytes by path and its terms (one pass over the pairs that move bytes)."""
    w = moves.world
    sent = [[0, 0] for _ in range(w)]  # [nvlink, net] per rank
    received = [[0, 0] for _ in range(w)]
    busiest = [(0.0, 0, False)] * w  # (seconds, bytes, crosses nodes) per rank
    nvl, net = hw.nvlink_gbs * 1e9, hw.net_gbs * 1e9
    per_node = hw.gpus_per_node
    for (s, d), n in moves.pairs.items():
        remote = s // per_node != d // per_node
        sent[s][remote] += n
        received[d][remote] += n
        t = n / (net if remote else nvl)
        if t > busiest[s][0]:
            busiest[s] = (t, n, remote)
        if t > busiest[d][0]:
            busiest[d] = (t, n, remote)
    return [_rank_time(r, sent[r], received[r], busiest[r], moves.local[r], hw) for r in range(w)]


def _rank_time(r: int, sent: list[int], received: list[int], busiest: tuple[float, int, bool],
               local: int, hw: Hardware) -> RankTime:
    nvl, net = hw.nvlink_gbs * 1e9, hw.net_gbs * 1e9
    terms = {
        "send": max(sent[0] / nvl, sent[1] / net),
        "receive": max(received[0] / nvl, received[1] / net),
        "link": busiest[0],
        "copy": 2 * local / (hw.copy_gbs * 1e9),
    }
    bound = max(terms, key=terms.__getitem__)
    return RankTime(r, sent[0], sent[1], received[0], received[1], busiest[1], busiest[2], local,
                    terms["send"], terms["receive"], terms["link"], terms["copy"], terms[bound], bound)
