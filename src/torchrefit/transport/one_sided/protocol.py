"""The one-sided protocol: one side reads or writes memory its peer registered.

Per pair of ranks one side is the *target* (its memory is registered and reached
remotely) and the other the *initiator* (it moves the bytes). A pull transport
(``ipc``) makes the receiver the initiator: it reads the sender's source tensors.
A push transport (``nixl``) makes the sender the initiator: it writes
into the receiver's destination tensors.

The order of one refit is written once, in ``execute.one_sided_program``; a transport
supplies the primitives it calls, and this base class the small control messages
(over the group's Gloo backend; for a one-host transport with ``mailbox``, after a
pair's first exchange only when they carry a new table or token, otherwise as words
in host shared memory, ``transport.one_sided.mailbox``):

1. target: ``ready()`` -> token, once everything queued on its current stream is
   ordered before the peer's access (the sender's producer for pull; for push, the
   receiver's readers of the old destination); a header carries the token, the
   target's generation and, the first time, its table (``expose``);
2. initiator: ``attach`` a new table, ``wait_ready(peer, token)`` (orders its
   transfer after the target's token and, for push, after its own producer),
   transfer, ``done()`` -> token, sent back;
3. target: ``wait_done(peer, token)``: its later work (the next optimizer step,
   the engine's reads) is ordered after the initiator's access.

A transport whose GPU streams can write the mailbox (:meth:`stream_writer`) may
return :data:`WORD` from ``ready()`` / ``done()``: its header or done word is then
written by its current stream, after the work the token orders, so the peer's host
seeing the word *is* the order and no token needs waiting for (no interprocess
event, no wait queued in another process's context). Where a peer has no mailbox
the base asks the transport for another token instead (:meth:`event_token`).
"""

from __future__ import annotations

import ctypes
import pickle
import struct
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist

from ... import settings
from ..._util.caller_state import outside_inference
from ...errors import TransportError
from ...layout._types import Box
from ..base import Transport, Waits, require_backend
from ..collectives import all_gather_pickled
from ..delegates import delegates_of
from ..delegates import enabled as delegates_enabled
from ..turns import Turn, chain_of, device_key
from .mailbox import Mailbox, done_word, header_word

__all__ = ["OneSidedTransport", "Table", "WORD"]

_HEADER, _TABLE, _DONE = 31, 32, 33  # gloo tags of the control messages
#: tables remembered per peer by default: a refit and a verify program alternate (a
#: Refitter with load_weights buckets raises it to hold each bucket's, ``keep_tables``)
_KEEP = 4
_FIXED = 128  # bytes of a header or token message (an interprocess event handle is 64)
# control messages live in host memory whatever the caller's default device: gloo carries
# them and ctypes reads them by address
_HOST = torch.device("cpu")

#: what a target tells an initiator once per compiled program: the transport's
#: description of its registered tensors, and per transfer (plan order) the index of
#: its tensor there and the region of that tensor (a rank whose copies a delegate does
#: adds a third item, what to copy: ``transport.delegates``; ``attach`` sees two)
Table = tuple[object, tuple[tuple[int, Box], ...]]

#: a ready or done token that orders nothing itself: the mailbox word sent with it was
#: written by the peer's stream after the work it stands for
WORD = b"stream word"


class OneSidedTransport(Transport):
    """Base of one-sided transports. Subclasses implement the primitives below; the
    executor (``execute.one_sided_program``) calls them in the protocol's order."""

    protocol = "one_sided"
    #: True: receivers read senders' memory (ipc); False: senders write receivers' memory
    pull: ClassVar[bool]
    #: one host: headers and done tokens with nothing new go through host shared memory
    #: (``transport.one_sided.mailbox``) instead of Gloo, unless ``settings.mailbox`` is off
    mailbox: ClassVar[bool] = False
    #: ranks copying on one shared GPU take turns (``transport.turns``); needs ``mailbox``
    turns: ClassVar[bool] = False
    #: pull only: where ranks copy on one shared GPU, the first copies for all of them
    #: (``transport.delegates``), rather than turns; needs ``turns``
    delegate: ClassVar[bool] = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        require_backend(group, "gloo", self.name, "exchanges its small control messages")
        self.rank = dist.get_rank(group)
        # peer -> generations whose table it holds, oldest first: the same sequence (and so the
        # same evictions) as the peer's ``_attached``, since tables arrive in the order sent
        self._announced: dict[int, OrderedDict[int, None]] = {}
        self.keep = _KEEP  # tables remembered per peer, the same on every rank
        self._attached: dict[int, OrderedDict[int, tuple]] = {}  # peer -> generation -> remote regions
        self._works: list = []  # posted gloo sends (peer, "send", work), with the tensors they read
        # per pair and direction (a collocated pair exchanges both ways), exchanges counted on
        # both ends: the header and done words carry the count
        self._exchanges: dict[tuple[str, int], int] = {}
        self._box: Mailbox | None = None  # target: this rank's words (made with its first table)
        self._boxed: set[int] = set()  # target: initiators that were sent its mailbox
        self._peer_boxes: dict[int, Mailbox] = {}  # initiator: the targets' mailboxes
        self._sent_token: dict[tuple[str, int], bytes] = {}  # last token sent over Gloo per pair
        self._sent_generation: dict[int, int] = {}  # per initiator, the generation of the last header over Gloo
        self._got: dict[tuple[str, int], object] = {}  # last header (generation, token) / done token
        self._writers: dict[Mailbox, Callable[[int, int], None] | None] = {}  # per mailbox, stream_writer's
        self.gloo_messages = 0  # control messages posted or received over Gloo (tests count them)
        self.turn: Turn | None = None  # this rank's place among ranks copying on its GPU, if shared
        self.delegates: dict[int, int] = {}  # rank -> the rank copying for it on a shared GPU
        self._tasks: dict[tuple[int, int], object] = {}  # (peer, generation) -> its work for this delegate
        self.waits = Waits()  # host polls, each spinning where the same wait ended last time
        # read once: ``ready()`` asks on every refit, right after the host waited, where
        # every Python step costs several times its warm time
        self._mailbox_on = self.mailbox and settings.current().mailbox

    def prepare(self, plan, message_limit: int) -> None:
        """Collective: where several ranks copy on this rank's GPU, one of them copies
        for all (``transport.delegates``, pull transports) or they take turns
        (``transport.turns``). Two small gathers: each rank's device, whether it copies
        and whether another process may copy for it; then the turn mailboxes of the
        ranks that take turns (none made elsewhere: one process per GPU registers
        nothing)."""
        if not (self.turns and self.mailbox):
            return
        copies = bool(plan.local) or bool(plan.recvs if self.pull else plan.sends)
        # FP8 quantizing runs this rank's own kernels around the exchange: not handed over
        eligible = self.pull and self.delegate and delegates_enabled() and not plan.quantize
        infos = all_gather_pickled((device_key(self.device), copies, eligible), self.group, self.timeout)
        keys, copying = [i[0] for i in infos], [i[1] for i in infos]
        self.delegates = delegates_of(keys, copying, [i[2] for i in infos])
        chain = [] if self.rank in self.delegates else chain_of(self.rank, keys, copying)
        own = None
        if chain and self.rank != chain[-1]:  # the last one's word nobody reads
            try:
                own = Mailbox.create(1)
            except (RuntimeError, OSError):  # no shared memory: nobody takes turns (below)
                own = None
        handles = all_gather_pickled(own.handle() if own is not None else None, self.group, self.timeout)
        if not chain or any(handles[r] is None for r in chain[:-1]):  # the same answer on every rank
            return
        k = chain.index(self.rank)
        previous = chain[k - 1] if k else None
        before = Mailbox.open(handles[previous]) if previous is not None else None
        self.turn = Turn(self.rank, previous, before, own, self._turn_writer(own))

    def copier_of(self, rank: int, compare: bool = False) -> int:
        """The rank that copies ``rank``'s receptions and local copies: its GPU's
        delegate (``transport.delegates``), else itself. Verify programs (``compare``)
        compare on each rank: never delegated."""
        return rank if compare else self.delegates.get(rank, rank)

    def copies_for(self, rank: int, compare: bool = False) -> tuple[int, ...]:
        """The ranks ``rank`` copies for as their delegate (itself first among them, in
        rank order), or () where it is no delegate."""
        if compare or self.delegates.get(rank) != rank:
            return ()
        return tuple(sorted(r for r, d in self.delegates.items() if d == rank))

    def keep_tables(self, programs: int) -> None:
        """Remember each peer's tables of ``programs`` programs at least (every rank the
        same number, before the first refit). Both ends forget a table in the same order,
        so a target sends it again after the initiator dropped it; with fewer kept than
        programs run in turn, every table would travel (and be opened) every refit."""
        self.keep = max(self.keep, programs)

    def _turn_writer(self, box: Mailbox | None) -> Callable[[int, int], None] | None:
        """Writes this rank's turn word after everything queued on its current stream:
        the transport's stream writer, else the host once the stream drained (CPU: the
        copies finished when they were queued)."""
        if box is None:
            return None
        writer = self._writer(box)
        if writer is not None or self.device.type != "cuda":
            return writer
        device = self.device

        def after_sync(index: int, value: int) -> None:
            torch.cuda.current_stream(device).synchronize()
            box.store(index, value)
        return after_sync

    def wait_turn(self) -> None:
        """Host, before this rank queues a refit's copies: the previous rank's copies of
        it finished (a no-op where this rank takes no turns)."""
        turn = self.turn
        if turn is not None and not turn.wait(self.waits.poller(("turn", turn.previous)), self.poll_timeout()):
            raise self.peer_error(turn.previous, "receive",
                                  TimeoutError(f"its turn {turn.taken} on the shared GPU never ended"))

    def post_turn(self) -> None:
        """After this rank's copies of a refit, in its current stream's order."""
        if self.turn is not None:
            self.turn.post()

    # ---------------------------------------------------------- primitives
    @abstractmethod
    def expose(self, tensors: Sequence[torch.Tensor]) -> object:
        """Target, at compile time: register ``tensors`` and return a picklable
        description an initiator's :meth:`attach` opens."""

    @abstractmethod
    def attach(self, peer: int, table: Table) -> tuple:
        """Initiator: open ``peer``'s table; one remote region per transfer (plan order).
        Pull transports return tensors this rank can copy from."""

    @abstractmethod
    def ready(self) -> bytes:
        """Target, per refit: a token recorded after this rank's current stream."""

    @abstractmethod
    def wait_ready(self, peer: int, token: bytes) -> None:
        """Initiator: order this rank's transfer after ``peer``'s ready token (and, for
        push, after this rank's own producer). The stale-read tests remove it."""

    @abstractmethod
    def done(self) -> bytes:
        """Initiator, once its transfer is queued (pull) or has landed (push)."""

    @abstractmethod
    def wait_done(self, peer: int, token: bytes) -> None:
        """Target: order this rank's later work after ``peer``'s transfer."""

    def write(self, peer: int, local: Sequence[torch.Tensor], remote: tuple) -> None:
        """Push only: write each local view into the matching remote region."""
        raise TransportError(f"the {self.name} transport does not write (it is a pull transport)")

    def finish_writes(self) -> None:
        """Push only: return once every write posted since the last call has landed."""

    def narrow(self, region: object, nbytes: int) -> object:
        """The first ``nbytes`` of a one-dimensional byte region :meth:`attach` returned
        (delta refits move a prefix of a registered slot, ``execute.delta_one_sided``)."""
        return region[:nbytes]

    def region_bytes(self, region: object) -> int:
        """Bytes of a region :meth:`attach` returned."""
        return region.numel() * region.element_size()

    def stream_writer(self, box: Mailbox) -> Callable[[int, int], None] | None:
        """A function writing ``(index, value)`` into ``box`` from this rank's current
        stream, after everything queued on it; None (the default): words are written
        by the host and the tokens order. Asked once per mailbox."""
        return None

    def event_token(self, role: str) -> bytes:
        """A ``role`` ("ready" or "done") token that orders by itself, for a peer that
        cannot see this rank's stream-written word. Transports that return :data:`WORD`
        implement it."""
        raise TransportError(f"{self.name}: returned a stream-word token but has no other {role} token")

    def own_stream_words(self) -> bool:
        """Target: whether this rank's mailbox exists (made now if needed) and its
        stream writes the words, so ``ready()`` may return :data:`WORD`."""
        return self._mailbox_handle() is not None and self._writer(self._box) is not None

    def _writer(self, box: Mailbox | None) -> Callable[[int, int], None] | None:
        if box is None:
            return None
        if box not in self._writers:
            self._writers[box] = self.stream_writer(box)
        return self._writers[box]

    def _post_word(self, box: Mailbox, index: int, seq: int, follows: bool, token: bytes) -> None:
        if token == WORD:  # in stream order: the peer seeing it is the order
            self._writer(box)(index, seq << 1 | int(follows))
        else:
            box.post(index, seq, follows)

    # ------------------------------------------- control messages (gloo or mailbox)
    def post_header(self, peer: int, generation: int, table: Table, token: bytes) -> None:
        """Target: tell ``peer`` this refit's ready token and generation, with the table
        the first time it needs it: over Gloo, or as a mailbox word when the peer holds
        this rank's mailbox and nothing is new."""
        seq = self._count("header out", peer)
        announced = self._announced.get(peer)
        if announced is None:
            announced = self._announced[peer] = OrderedDict()
        new = generation not in announced
        boxed = peer in self._boxed
        if token == WORD and not (boxed or new):  # the peer cannot be sent this rank's mailbox
            token = self.event_token("ready")
        # another program's table (a refit's, a stage's) than the last header named: the
        # peer would otherwise take the word as the last header's generation again
        follows = (not boxed or new or self._sent_token.get(("header", peer)) != token
                   or self._sent_generation.get(peer) != generation)
        if follows:
            handle = self._mailbox_handle() if new and not boxed else None
            blob = pickle.dumps((table, handle)) if new else b""
            self._send(peer, struct.pack("<qq", generation, len(blob)) + token, _HEADER)
            if new:
                self._send(peer, blob, _TABLE, fixed=False)
                announced[generation] = None
                while len(announced) > self.keep:  # the peer forgets the same one (recv_header)
                    announced.popitem(last=False)
            self._sent_token["header", peer] = token
            self._sent_generation[peer] = generation
            if handle is not None:  # the peer maps it while reading this header
                self._boxed.add(peer)
        if boxed or (token == WORD and peer in self._boxed):  # a stream word orders even the first
            self._post_word(self._box, header_word(peer), seq, follows, token)

    @outside_inference  # a peer's table is opened here, on the first refit after it changed
    def recv_header(self, peer: int) -> tuple[int, bytes, tuple]:
        """Initiator: ``peer``'s generation, ready token and remote regions."""
        seq = self._count("header in", peer)
        box = self._peer_boxes.get(peer)
        taken = box is not None
        if taken and not self._take(box, header_word(self.rank), seq, peer, "header"):
            generation, token = self._got["header", peer]
            return generation, token, self._attached[peer][generation]
        data = self._recv(peer, _HEADER)
        generation, size = struct.unpack_from("<qq", data)
        token = data[16:]
        regions = self._attached.setdefault(peer, OrderedDict())
        if size:
            table, handle = pickle.loads(self._recv(peer, _TABLE, fixed=False))
            regions[generation] = self._attach_table(peer, table[:2])
            if len(table) > 2:  # a rank this one copies for: what to copy (execute.one_sided_program.Work)
                self._tasks[peer, generation] = table[2]
            if handle is not None:
                box = self._peer_boxes[peer] = self._open_mailbox(peer, handle)
            while len(regions) > self.keep:  # the oldest table sent: the peer forgot it too
                self._tasks.pop((peer, regions.popitem(last=False)[0]), None)
        if generation not in regions:
            raise TransportError(f"{self.name}: rank {peer} sent generation {generation} without its table")
        if token == WORD and not taken:  # the first header: its order is the word, written after it
            if box is None:
                raise TransportError(f"{self.name}: rank {peer} ordered its header by a mailbox word it never "
                                     "shared with this rank", ranks=(peer,), rule="out of step")
            self._take(box, header_word(self.rank), seq, peer, "header")
        self._got["header", peer] = (generation, token)
        return generation, token, regions[generation]

    def _attach_table(self, peer: int, table: Table) -> tuple:
        """:meth:`attach`, with a failure to open the peer's memory (it freed or re-exposed
        it, or died, since it sent the table) raised as the peer's TransportError."""
        try:
            return self.attach(peer, table)
        except TransportError:
            raise
        except Exception as e:  # noqa: BLE001 (the backend's own error, whatever its type)
            raise TransportError(
                f"{self.name}: cannot open the memory rank {peer} exposed ({type(e).__name__}: {e}); the "
                "peer freed it, re-exposed it or died since it sent its table: rebuild the Refitter",
                ranks=(peer,), rule="peer memory") from e

    def work_of(self, peer: int, generation: int) -> object:
        """Delegate: the work ``peer`` sent with its table of ``generation`` (None where
        it sent none: it only exposes sources)."""
        return self._tasks.get((peer, generation))

    def post_done(self, peer: int, token: bytes) -> None:
        seq = self._count("done out", peer)
        box = self._peer_boxes.get(peer)
        if token == WORD and self._writer(box) is None:  # no word of this rank's stream reaches the peer
            token = self.event_token("done")
        follows = box is None or self._sent_token.get(("done", peer)) != token
        if follows:
            self._send(peer, token, _DONE)
            self._sent_token["done", peer] = token
        if box is not None:
            self._post_word(box, done_word(self.rank), seq, follows, token)

    def recv_done(self, peer: int) -> bytes:
        seq = self._count("done in", peer)
        if peer in self._boxed and not self._take(self._box, done_word(peer), seq, peer, "done token"):
            return self._got["done", peer]
        token = self._recv(peer, _DONE)
        self._got["done", peer] = token
        return token

    def _count(self, kind: str, peer: int) -> int:
        seq = self._exchanges[kind, peer] = self._exchanges.get((kind, peer), 0) + 1
        return seq

    def _mailbox_handle(self) -> tuple | None:
        """This rank's mailbox handle for a new initiator; None: Gloo only (no mailbox
        for this transport, turned off, or shared memory unavailable)."""
        if not self._mailbox_on:
            return None
        if self._box is None:
            try:
                self._box = Mailbox.create(dist.get_world_size(self.group))
            except (RuntimeError, OSError):  # no shared memory here: stay on Gloo
                return None
        return self._box.handle()

    def _open_mailbox(self, peer: int, handle: tuple) -> Mailbox:
        try:
            return Mailbox.open(handle)
        except (RuntimeError, OSError) as e:  # the target then times out waiting for this rank
            raise TransportError(f"{self.name}: cannot map rank {peer}'s control words in shared memory "
                                 f"({e}); set TORCHREFIT_MAILBOX=0 (settings.mailbox) on every rank", ranks=(peer,),
                                 rule="shared memory") from e

    def _take(self, box: Mailbox, index: int, seq: int, peer: int, what: str) -> bool:
        """Wait for ``peer``'s word of exchange ``seq``; whether a Gloo message follows."""
        try:
            follows = box.take(index, seq, self.poll_timeout(), self.waits.poller((what, peer)))
        except ValueError as e:
            raise TransportError(f"{self.name}: rank {peer}'s {what}: {e}; the refits disagree: "
                                 "rebuild the Refitter", ranks=(peer,), rule="out of step") from None
        if follows is None:
            raise self.peer_error(peer, "receive", TimeoutError(f"its {what} {seq} never came"))
        return follows

    def settle(self) -> None:
        """Wait for every control message this rank posted (end of a refit), within
        ``timeout`` (a peer that died raises :class:`TransportError` naming it)."""
        if not self._works:  # the mailbox carried this refit's words: no Gloo message to wait for
            return
        works, self._works = self._works, []
        self.wait([w for w, _ in works])

    def _send(self, peer: int, data: bytes, tag: int, fixed: bool = True) -> None:
        """Post ``data`` to ``peer``: in one fixed-size message (headers and tokens, one
        network latency per refit step), or a size then the body (tables)."""
        if fixed:
            if len(data) > _FIXED - 8:
                raise TransportError(f"{self.name}: a {len(data)}-byte control message exceeds {_FIXED - 8}")
            buf = torch.zeros(_FIXED, dtype=torch.uint8, device=_HOST)
            buf[:8] = torch.frombuffer(bytearray(struct.pack("<q", len(data))), dtype=torch.uint8)
            if data:
                buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._post_send(peer, buf, tag)
            return
        self._post_send(peer, torch.tensor([len(data)], dtype=torch.int64, device=_HOST), tag)
        if data:
            self._post_send(peer, torch.frombuffer(bytearray(data), dtype=torch.uint8), tag)

    def _post_send(self, peer: int, buf: torch.Tensor, tag: int) -> None:
        self.gloo_messages += 1
        (posted,) = self.post([(peer, buf)], [], lambda _, dst, t: dist.isend(t, dst, self.group, tag=tag))
        self._works.append((posted, buf))

    def _recv_into(self, peer: int, buf: torch.Tensor, tag: int) -> None:
        """Receive into ``buf`` within ``timeout`` (a blocking gloo receive from a peer
        that died would wait for the group's own timeout, 30 minutes by default)."""
        self.gloo_messages += 1
        self.wait(self.post([], [(peer, buf)], lambda _, src, t: dist.irecv(t, src, self.group, tag=tag)))

    def _recv(self, peer: int, tag: int, fixed: bool = True) -> bytes:
        if fixed:
            buf = torch.empty(_FIXED, dtype=torch.uint8, device=_HOST)
            self._recv_into(peer, buf, tag)
            (n,) = struct.unpack_from("<q", ctypes.string_at(buf.data_ptr(), 8))
            return ctypes.string_at(buf.data_ptr() + 8, n)
        size = torch.empty(1, dtype=torch.int64, device=_HOST)
        self._recv_into(peer, size, tag)
        if not int(size):
            return b""
        body = torch.empty(int(size), dtype=torch.uint8, device=_HOST)
        self._recv_into(peer, body, tag)
        return ctypes.string_at(body.data_ptr(), int(size))

    def close(self) -> None:
        self.turn = None
        self._attached.clear()
        self._tasks.clear()
        self._announced.clear()
        self._peer_boxes.clear()
        self._boxed.clear()
        self._writers.clear()
        self._box = None
