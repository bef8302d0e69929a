"""One parameter server: owns a shard of the parameters and the optimizer state for it.

Words (layout words are ``sharding.py``'s, message words ``protocol.py``'s):

- *version*: how many updates this server has applied to its shard. Synchronous: version v
  means steps 0..v-1 are applied. Asynchronous: every worker's gradient is one update.
- *clock* of a worker: how many complete pushes of its gradient this server has taken from it.
- *complete push*: a worker's gradients for every partition of this shard for one step. Values
  land in that worker's own staging buffer as they arrive; only a complete push is ever used,
  under the server's lock, so a worker that dies half-way through a push changes nothing
  (*atomic per shard step*).
- *synchronous* (strategy "sync", "sharded"): a *partition's* step v is applied the moment every
  worker's gradient of it for step v is in: the server sums them in worker order (0, 1, ..., W-1),
  divides by W and applies the job's optimizer to that partition (torch.optim.SGD, Adam or AdamW
  over one view per partition, its state kept here: SGD's momentum buffer, Adam's moments and step
  count, *the partition's state*), and at once sends the partition's new values to every worker
  whose pull for step v+1 is registered, while later partitions' gradients still arrive: pushes
  and pulls overlap on the full-duplex link (*streamed pulls*; the worker sends its pull for step
  v+1 before its first push of step v). ``version`` counts steps applied to every partition.
  Before a partition's first update of a step its values and state are kept, so that a step cut
  short (a lost worker, a timeout) is rolled back to version v everywhere: the shard is never left
  half-updated. A worker lost before the step is done ends the job: every other worker gets an
  error naming it.
- *asynchronous* ("async"): each complete push is applied on arrival, scaled by 1/W so that W
  updates move the parameters as far as one synchronous step. Its *staleness* is the number of
  updates applied since the parameters it was computed from (version now - version pulled),
  counted in a histogram. A pull from a worker whose clock is more than ``max_staleness`` ahead
  of the slowest live worker's waits (stale-synchronous parallel); answers (the whole shard as it
  is when the answer's turn comes) go out one at a time, in the order the pulls came
  (``_answer_in_turn``). A lost worker is dropped and the rest go on; the server logs it and
  tells workers how many remain with every answer.

- *checkpoint of step s* (SAVE): the shard as it was at version s, whatever came in since:
  synchronous, partitions already stepped past s are saved with their values and state from before
  that step (kept from the last step, ``_prev``, and the step in progress, ``_undo``), so a worker
  that saves between backward and ``step()`` saves a consistent shard. Every worker's clock is
  saved as s, asynchronous too (async has no global step: every worker resumes at the saving
  worker's step, on every server alike). The strategy and the optimizer are saved, and a job of
  the other kind, or with another optimizer, refuses the checkpoint. A save that fails (no
  checkpoint directory, a write error) is answered with the reason and the job goes on. A SAVE
  marked *background* is answered once the shard is copied and written on a thread
  (checkpoint_writer; one write at a time, one more copy queued behind it), so that the saving
  worker, and the others that wait for its next push, do not wait for the disk (a write longer
  than ``timeout`` failed the job); the error of such a write is the answer to a later SAVE, and
  fails serve() at the end.
- *resume*: at the newest step whose shard file is whole in every server's folder this one can
  see, if this job may take it (``shard_resume``): this server's own file of it, or, where the save
  was made for another layout (another number of servers, a synchronous job), this server's
  partitions cut from every server's file of it. What a HELLO and a ServerConfig hold is
  ``server_config``'s.

Threads: one per connection reads that worker's messages in order; synchronous servers add
one *outbox* sender per worker, so that answering one worker's pull never stalls reading another
worker's push. Every wait ends by ``timeout`` with CommTimeout naming who is missing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .. import checkpoint
from ..errors import CommError, CommTimeout, MismatchError, PeerLost, ProtocolError
from ..transport import tcp_setup
from . import protocol as P
from . import shard_resume
from .server_config import HELLO_KEYS, MAX_PARTITIONS, ServerConfig, check_hello, format_shape
from .server_optimizer import torch_optimizer
from .sharding import layout_digest, make_layout, partition_count

log = logging.getLogger(__name__)

_NOTHING = object()  # (the send loop: no item taken ahead)
#: A synchronous push's partitions are counted (stepped, streamed back) as they arrive, in runs
#: of at least this many bytes: a partition of 4 MiB alone, 64 KiB of small ones together. One
#: at a time, a push of many small tensors took one optimizer step, undo copy and PARAMS message
#: per partition: 1,500 a step per server at 3,000 parameters (server CPU 300-600 ms a step).
STEP_RUN_BYTES = 64 << 10


class _SaveRefused(Exception):
    """A checkpoint this server cannot write: answered to the worker that asked, serving goes on."""


class ParameterServer:
    """Listen, admit authenticated workers, and serve one shard until every worker is done."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.name = f"parameter server {cfg.index}"
        self._me = P.ps_identity(cfg.index, cfg.servers + cfg.workers, cfg.job, cfg.secret)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((cfg.host, cfg.port))
        self._listener.listen(128)
        self.endpoint = (cfg.host, self._listener.getsockname()[1])
        self.refused = 0
        self._cond = threading.Condition()
        self._seen_nonces: set[bytes] = set()
        W = cfg.workers
        self._status = ["waiting"] * W  # waiting, connected, bye, lost
        self._heard = [0.0] * W  # monotonic time of each worker's last message
        self._lost_why: dict[int, str] = {}  # why each lost worker was lost (told to it if it comes back)
        self._dropped: set[int] = set()  # workers lost for silence while connected: told why as theirs closes
        self._serving: set[int] = set()  # workers whose message waits in _wait_until or for its turn
        self._pulls_seen = 0  # async: pulls taken so far (each one's ticket: its number)
        self._turns: list[int] = []  # async: tickets of the pulls cleared to be answered, waiting for the wire
        self._answering = False  # async: an answer of whole shards is on the wire in its turn
        self._turn_copy: Optional[torch.Tensor] = None  # async: the shard's values that answer carries
        self._writer = checkpoint.CheckpointWriter(cfg.shard_dir) if cfg.shard_dir else None
        # The writer is not thread-safe, and every worker's connection thread may ask for a save
        # (every worker does where each calls save_checkpoint): one save at a time.
        self._save_lock = threading.Lock()
        self.write_error: Optional[OSError] = None  # a background write that failed after the last SAVE
        self._first_connected: Optional[float] = None
        self._channels: dict[int, P.Channel] = {}
        self._threads: list[threading.Thread] = []  # connection threads (serve() joins them)
        self._outboxes: dict[int, queue.Queue] = {}
        self._bytes = {w: [0, 0] for w in range(W)}  # sent to, received from
        self.failed: Optional[CommError] = None
        self.notices: list[str] = []
        self.staleness: Counter[int] = Counter()
        self._settings: Optional[dict] = None
        self._initialized = False
        self._resume = (shard_resume.newest_whole(Path(cfg.checkpoint_dir), cfg.servers, cfg.index, self.name)
                        if cfg.resume and cfg.checkpoint_dir else None)
        if cfg.shard_dir:
            # Made now (after this server chose its step), not at the first save: a folder that is
            # not there is then another machine's disk (shard_resume), never that of a server of
            # this disk stopped before its first save, whose missing file tells a save cut short.
            # One that cannot be made fails the first save, as a full disk does (SAVE's error).
            with contextlib.suppress(OSError):
                Path(cfg.shard_dir).mkdir(parents=True, exist_ok=True)
        self.version = 0
        self.updates = 0

    # --- set-up -------------------------------------------------------------------------------
    def _configure(self, hello: dict) -> None:
        """First HELLO (checked by check_hello): build the layout and optimizer. Later ones must agree
        with it, the layout digest first (caller holds lock)."""
        if self._settings is not None:
            diff = [k for k in HELLO_KEYS if self._settings[k] != hello[k]]
            if diff:
                values = "".join(f"; its {k} is {hello[k]!r}, the first worker's {self._settings[k]!r}" for k in diff
                                 if k in ("strategy", "optimizer", "lr", "momentum", "betas", "eps", "weight_decay",
                                          "partition_bytes"))
                raise MismatchError(f"worker {hello['worker']} disagrees with the other workers about {diff}"
                                    + values + _first_difference(hello["shapes"], self._settings["shapes"]))
            return
        numels, partition_bytes = hello["numels"], hello["partition_bytes"]
        if layout_digest(numels, self.cfg.servers, partition_bytes) != hello["digest"]:
            raise MismatchError("the worker's layout digest differs from the one this server computes "
                                f"for {self.cfg.servers} server(s)")
        if hello["strategy"] != self.cfg.strategy:
            raise MismatchError(f"worker uses strategy {hello['strategy']!r}, this server {self.cfg.strategy!r}")
        parts = partition_count(numels, partition_bytes)
        if parts > MAX_PARTITIONS:
            raise ProtocolError(f"HELLO asks for {parts} partitions, more than a server serves ({MAX_PARTITIONS}): "
                                "use larger partitions")
        try:
            layout = make_layout(numels, self.cfg.servers, partition_bytes)
        except ValueError as exc:
            raise MismatchError(f"{self.name} cannot serve this model: {exc}") from None
        lr = hello["lr"]
        self.layout = layout
        self.shard = layout.shard(self.cfg.index)
        self.shard_ids = np.array([p.id for p in self.shard], dtype=np.int64)
        self.offsets = layout.offsets(self.cfg.index)
        self.numel_of = {p.id: p.numel for p in self.shard}
        n = sum(self.numel_of.values())
        self.params = torch.zeros(n, dtype=torch.float32)
        # One view per partition, so that a partition can be stepped alone (elementwise: the same
        # bits as one step over the whole shard).
        self._views = {i: self.params[self.offsets[i]: self.offsets[i] + self.numel_of[i]]
                       for i in self.shard_ids.tolist()}
        self.opt = torch_optimizer(hello["optimizer"], list(self._views.values()), hello)
        W = self.cfg.workers
        self._grads = [torch.zeros(n, dtype=torch.float32) for _ in range(W)]
        self._got = [set() for _ in range(W)]  # partition ids received for the current push
        self._clock = [0] * W
        self._complete = [False] * W  # sync: worker's push for step `version` is complete
        self._count = dict.fromkeys(self._views, 0)  # sync: workers' gradients in, per partition
        self._part_version = dict.fromkeys(self._views, 0)  # sync: steps applied, per partition
        self._undo: dict[int, tuple] = {}  # sync: values and state (_copy_state) before this step's update
        self._prev: dict[int, tuple] = {}  # sync: the same for the last step completed (for SAVE)
        self._want: list[Optional[int]] = [None] * W  # sync: the step each worker's pull asks for
        self._step_lr: Optional[tuple[float, int]] = None  # sync: step `version`'s learning rate, who sent it first
        self._lr_of = [lr] * W  # async: each worker's learning rate for the push it is sending
        # Configured only once the checkpoint is taken: one it refuses (MismatchError) leaves the
        # server unconfigured, so every worker's HELLO meets the same refusal and reports it.
        if self._resume is not None:
            try:
                self._restore(self._resume, hello)
            except MismatchError as exc:
                if not self.cfg.synchronous:  # (synchronous: every lost worker fails the job anyway)
                    self._fail(exc)
                raise
            self._resume = None  # (taken: its tensors are not kept for the server's lifetime)
        self._settings = {k: hello[k] for k in HELLO_KEYS}

    def _restore(self, saved: shard_resume.SavedStep, hello: dict) -> None:
        """Take the save ``saved`` (shard_resume): this server's own file of it, or, made for another
        layout (another number of servers), this server's partitions cut from every server's file."""
        old = shard_resume.check_resumable(saved, self.layout, hello, self.cfg, self.name)
        if old.digest() != self.layout.digest():
            payload = shard_resume.repartition(saved, old, self.layout, self.cfg.index, self.name)
        elif saved.own:
            payload = saved.payload
        else:
            raise MismatchError(f"{self.name}: the checkpoint of step {saved.step} in {self.cfg.checkpoint_dir} has no "
                                f"file of this server: {saved.files[self.cfg.index]} is missing (its folder is not "
                                "there): put it back, or remove the other servers' files of that step to resume "
                                "the step before, or start a new checkpoint directory")
        self.params.copy_(payload["params"])
        state = shard_resume.optimizer_state(payload)
        for k, (i, view) in enumerate(self._views.items()):  # (the order _optimizer_state saves in)
            off = self.offsets[i]
            entries = {key: flat[off: off + view.numel()].clone() for key, flat in state["elements"].items()}
            entries.update({key: flat[k].clone() for key, flat in state["partitions"].items()})
            if entries:
                self.opt.state[view] = entries
        self.version = int(payload["version"])
        self._part_version = dict.fromkeys(self._views, self.version)
        self._clock = [int(c) for c in payload["clocks"]]
        self.staleness.update({int(k): int(v) for k, v in payload.get("staleness", {}).items()})
        self._initialized = True
        log.info("%s resumed at version %d from %s", self.name, self.version, self.cfg.shard_dir)

    # --- the serving loop ---------------------------------------------------------------------
    def serve(self) -> dict:
        """Serve until every worker has said BYE or been lost; return the counters (stats())."""
        acceptor = threading.Thread(target=self._accept_loop, name=f"ps{self.cfg.index}-accept", daemon=True)
        acceptor.start()
        first_deadline = time.monotonic() + self.cfg.join_s
        failed_at: Optional[float] = None
        try:
            with self._cond:
                while not self._finished():
                    now = time.monotonic()
                    if all(s == "waiting" for s in self._status) and now > first_deadline:
                        self.failed = self.failed or CommTimeout(
                            f"{self.name}: no worker connected within {self.cfg.join_s:g} s (join_timeout)")
                        break
                    self._drop_absent(now)
                    if self.failed is not None:
                        failed_at = failed_at or now
                        if now - failed_at > self.cfg.timeout:  # workers told; do not wait for ever
                            break
                    self._cond.wait(0.2)
        finally:  # also on Ctrl-C: a shard being saved is finished (or its temporary file removed)
            self._close_listener()
            acceptor.join(1.0)
            self._join_connections()
            self._finish_writes()
        return self.stats()

    def _finish_writes(self) -> None:
        """Wait for a checkpoint written in the background; keep its error in ``write_error``
        (run_server raises it: the job's last checkpoint was not written)."""
        if self._writer is None:
            return
        try:
            self._writer.wait()
        except OSError as exc:
            log.error("%s could not write its last checkpoint to %s: %s", self.name, self.cfg.shard_dir, exc)
            self.write_error = exc

    def _join_connections(self, limit: float = 5.0) -> None:
        """Wait (at most ``limit`` s) for every connection thread to end: stats() then counts every
        worker's bytes, and no thread of this server still runs when serve() returns (the process
        may exit next, and a daemon thread cut off inside torch at interpreter exit aborts it). A
        failed job's workers still connected are cut off first (they were told why)."""
        with self._cond:
            threads = list(self._threads)
            if self.failed is not None:
                for w, ch in self._channels.items():
                    if self._status[w] == "connected":
                        ch.close()  # its reader wakes up and ends
        deadline = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _close_listener(self) -> None:
        """Shut the listener down first: close() alone does not wake a thread blocked in accept()."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _drop_absent(self, now: float, holding_up: Sequence[int] = ()) -> None:
        """Lose the workers the job cannot wait for any longer (caller holds the lock): one that has
        not connected ``join_timeout`` after the first did; one silent for ``timeout`` that holds up
        another's pull (asynchronous: ``holding_up``, behind the staleness bound; synchronous: one
        that has not pushed the step another waits for). A worker busy for long between steps is
        left alone otherwise. A synchronous job then ends with the error naming the worker; an
        asynchronous one goes on without them and says so."""
        if self._first_connected is None:
            return
        join = self.cfg.join_s
        for w, status in enumerate(self._status):
            if status == "waiting" and now - self._first_connected >= join:
                self._lost(w, f"it did not connect within {join:g} s of the first worker (join_timeout)")
        limit = self.cfg.timeout
        if self.cfg.synchronous:
            holding_up = self._holding_up_step()
        for w in holding_up:
            if self._status[w] != "connected" or w in self._serving:  # (waiting for this server is not silence)
                continue
            if now - self._heard[w] >= limit:
                self._lost(w, f"it sent nothing for {limit:g} s while holding up the others' pulls")
                # Its reader wakes up and ends now; its connection's thread tells the worker why
                # before it closes (the worker read a closed connection as this server's death).
                self._dropped.add(w)
                self._channels[w].shut_reading()

    def _holding_up_step(self) -> list[int]:
        """Sync: the connected workers whose gradients of the step in progress are not all in
        while another connected worker waits for its parameters (caller holds the lock)."""
        if not self._initialized:  # (no step before worker 0's INIT: nor the step's counters)
            return []
        pulled = {u for u in range(self.cfg.workers)
                  if self._want[u] == self.version + 1 and self._status[u] == "connected"}
        return [u for u in self._missing() if self._status[u] == "connected" and pulled - {u}]

    def _finished(self) -> bool:
        """Every worker said BYE or was lost; a failed job also ends once none is connected, but still
        listens for workers that have not connected yet (up to ``timeout``), so that they hear why
        instead of finding the port closed."""
        if self.failed is not None:
            return not any(s in ("connected", "waiting") for s in self._status)
        return all(s in ("bye", "lost") for s in self._status)

    def stats(self) -> dict:
        with self._cond:
            for w, ch in self._channels.items():
                self._bytes[w] = [ch.bytes_sent, ch.bytes_received]
            return {
                "server": self.cfg.index,
                "strategy": self.cfg.strategy,
                "version": self.version,
                "updates": self.updates,
                "bytes_sent": sum(b[0] for b in self._bytes.values()),
                "bytes_received": sum(b[1] for b in self._bytes.values()),
                "bytes_per_worker": {str(w): {"sent": b[0], "received": b[1]} for w, b in self._bytes.items()},
                "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
                "refused_connections": self.refused,
                "notices": list(self.notices),
                "failed": None if self.failed is None else f"{type(self.failed).__name__}: {self.failed}",
            }

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # listener closed
            thread = threading.Thread(target=self._connection, args=(sock, addr), daemon=True,
                                      name=f"ps{self.cfg.index}-connection")
            with self._cond:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _handshake_name(self, rank: int) -> str:
        """How a refused handshake names a rank: servers take 0..K-1, worker w is K + w."""
        K = self.cfg.servers
        return f"worker {rank - K}" if rank >= K else f"parameter server {rank}"

    def _connection(self, sock: socket.socket, addr) -> None:
        """Handshake, HELLO, then this worker's messages in order, until BYE or loss."""
        K = self.cfg.servers
        # No Nagle delay: answers stream out as partitions are applied, and a message's last short
        # segment must not wait for the ACK of everything before it. (The kernel's buffer sizes
        # and congestion control stay: see tcp_setup.TCP_CONGESTION.)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cond:  # (a lost or connected one too: it is told why it is not taken, below)
            expected = {K + w for w, s in enumerate(self._status) if s in ("waiting", "lost", "connected")}
        try:
            rank = tcp_setup.accept_handshake(sock, self._me, expected, self._seen_nonces,
                                              time.monotonic() + min(self.cfg.timeout, tcp_setup.HANDSHAKE_TIMEOUT),
                                              name=self._handshake_name)
        except Exception as exc:  # noqa: BLE001 - whatever a stranger's bytes raise, it is refused
            with self._cond:
                self.refused += 1
            log.warning("%s refused a connection from %r: %s: %s", self.name, addr, type(exc).__name__, exc)
            sock.close()
            return
        w = rank - K
        ch = P.Channel(sock, f"worker {w}", self.cfg.timeout)
        outbox: queue.Queue = queue.Queue()
        with self._cond:
            status = self._status[w]
            if status == "waiting":
                self._status[w] = "connected"
                self._heard[w] = time.monotonic()
                if self._first_connected is None:
                    self._first_connected = self._heard[w]
                self._channels[w] = ch
                self._outboxes[w] = outbox
                self._cond.notify_all()
            else:  # two handshakes raced for one rank, or a lost one came back
                self.refused += 1
        if status != "waiting":
            if status == "lost":  # (authenticated: it may hear why)
                ch.send_abort(self._dropped_error(w))
            elif status == "connected":  # (a second process given the same worker index, most often)
                ch.send_abort(MismatchError(
                    f"{self.name}: worker {w} is connected already, so this second connection as worker {w} is "
                    f"refused: give each worker process its own worker index in [0, {self.cfg.workers}) "
                    "(ParameterServerTraining's worker=)"))
            ch.close()
            return
        sender = threading.Thread(target=self._send_loop, args=(w, ch, outbox), daemon=True,
                                  name=f"ps{self.cfg.index}-w{w}-outbox")
        sender.start()
        try:
            self._talk(w, ch, outbox, sender)
        except EOFError:
            self._lost(w, "closed its connection without BYE")
        except CommError as exc:
            self._lost(w, f"{type(exc).__name__}: {exc}")
            ch.send_abort(exc)  # best effort: a worker that is gone does not read it
        except OSError as exc:  # its socket closed under the read (_drop_absent) or reset
            self._lost(w, f"connection failed: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bug or input no check foresaw: never a silent hang
            log.exception("%s: serving worker %d failed", self.name, w)
            error = ProtocolError(f"{self.name} could not serve worker {w}: {type(exc).__name__}: {exc}")
            self._lost(w, str(error))
            ch.send_abort(error)
        finally:
            outbox.put(None)
            sender.join(self.cfg.timeout)
            if w in self._dropped:  # (after the sender: no frame of its own cut in two)
                ch.send_abort(self._dropped_error(w))
            ch.close()
            with self._cond:
                self._bytes[w] = [ch.bytes_sent, ch.bytes_received]
                self._cond.notify_all()

    def _send_loop(self, w: int, ch: P.Channel, outbox: queue.Queue) -> None:
        """Worker w's outbox: streamed partitions (merged while they queue up) and the BYE answer;
        None ends it, also when it was taken while merging."""
        later = _NOTHING  # an item taken while merging, handled next
        try:
            while True:
                item, later = outbox.get() if later is _NOTHING else later, _NOTHING
                if item is None:
                    return
                if item[0] == "bye":
                    ch.send(P.BYE, body=P.encode_json(self.stats()))
                    return
                _, step, ids = item
                while True:  # partitions applied while the last message was on the wire go out together
                    try:
                        taken = outbox.get_nowait()
                    except queue.Empty:
                        break
                    if taken is not None and taken[0] == "params" and taken[1] == step:
                        ids = ids + taken[2]
                    else:
                        later = taken
                        break
                with self._cond:
                    live = sum(s != "lost" for s in self._status)
                self._send_params(ch, w, step, step, live, ids, self.params)
        except CommError as exc:
            self._lost(w, f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            self._lost(w, f"connection failed: {exc}")

    def _send_params(self, ch: P.Channel, w: int, step: int, version: int, live: int, ids: list[int],
                     values: torch.Tensor) -> None:
        flat = values.numpy()
        views = [flat[self.offsets[i]: self.offsets[i] + self.numel_of[i]] for i in ids]
        ch.send(P.PARAMS, worker=w, step=step, version=version, extra=live,
                ids=np.array(ids, dtype=np.int64), values=views)

    def _lost(self, w: int, why: str) -> None:
        with self._cond:
            if self._status[w] in ("bye", "lost"):
                return
            self._status[w] = "lost"
            self._lost_why[w] = why
            if self._settings is not None:
                self._got[w].clear()  # a half-received push is dropped, never applied
                self._complete[w] = False
            if self.cfg.synchronous:
                self._fail(PeerLost(f"{self.name}: worker {w} was lost at step {self.version} ({why}); "
                                    "synchronous training cannot go on without it"), but=w)
            else:
                live = sum(s != "lost" for s in self._status)
                note = (f"{self.name}: worker {w} was lost at version {self.version} ({why}); continuing with "
                        f"{live} worker{'s' if live != 1 else ''}")
                self.notices.append(note)
                log.warning("%s", note)
            self._cond.notify_all()

    def _dropped_error(self, w: int) -> PeerLost:
        """What lost worker w hears if it is still there, or comes back."""
        goes_on = "the job has failed" if self.cfg.synchronous else "the asynchronous job goes on without it"
        return PeerLost(f"{self.name}: worker {w} was dropped ({self._lost_why.get(w)}) and is not taken back: "
                        f"{goes_on}")

    def _fail(self, error: CommError, but: Optional[int] = None) -> None:
        """End the job (any synchronous failure; an asynchronous job that cannot start): roll the step in
        progress back, tell every connected worker (caller holds lock)."""
        if self.failed is not None:
            return
        self.failed = error
        log.error("%s", error)
        if self._settings is not None:
            self._rollback()
        others = [ch for u, ch in self._channels.items() if u != but and self._status[u] == "connected"]
        threading.Thread(target=_tell_all, args=(others, error), daemon=True).start()
        self._cond.notify_all()

    def _talk(self, w: int, ch: P.Channel, outbox: queue.Queue, sender: threading.Thread) -> None:
        head = ch.recv_header(self.cfg.timeout)
        if head.kind != P.HELLO:
            raise ProtocolError(f"worker {w} sent {head.name} before HELLO")
        hello = check_hello(ch.recv_json(head), f"worker {w}")
        if hello["worker"] != w:
            raise ProtocolError(f"worker {w} authenticated as ps rank {w + self.cfg.servers} but says worker {hello['worker']}")
        with self._cond:
            self._configure(hello)
            welcome = {"version": self.version, "clock": self._clock[w], "optimizer": self._settings["optimizer"],
                       "needs_init": not self._initialized and w == 0,
                       "max_staleness": 0 if self.cfg.synchronous else self.cfg.max_staleness}
        ch.send(P.WELCOME, body=P.encode_json(welcome))
        while True:
            head = ch.recv_header(None)
            self._heard[w] = time.monotonic()  # (read by _drop_absent: a silent worker is lost in the end)
            self._check_failed()
            if head.kind == P.PUSH:
                self._on_push(w, ch, head)
            elif head.kind == P.PULL:
                self._on_pull(w, ch, head)
            elif head.kind == P.INIT:
                self._on_init(w, ch, head)
            elif head.kind == P.SAVE:
                self._on_save(w, ch, head)
            elif head.kind == P.BYE:
                if head.body:
                    raise ProtocolError(f"worker {w} sent a BYE with a body")
                self._on_bye(w, outbox, sender)
                return
            else:
                raise ProtocolError(f"worker {w} sent {head.name}, which workers do not send")

    def _check_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    # --- messages -------------------------------------------------------------------------------
    def _read_ids(self, ch: P.Channel, head, exact_all: bool) -> list[int]:
        """Read ``count`` partition ids and check them and the message's length."""
        ids = ch.recv_ids(head, len(self.shard_ids))
        if exact_all and not np.array_equal(ids, self.shard_ids):
            raise ProtocolError(f"{P.KIND_NAMES[head.kind]} must carry every partition of this shard in order")
        if len(set(ids.tolist())) != len(ids) or any(int(i) not in self.offsets for i in ids):
            raise ProtocolError(f"{head.name} names partitions this server does not own (or twice)")
        expected = 4 * sum(self.numel_of[int(i)] for i in ids)
        if head.body != 4 * len(ids) + expected:
            raise ProtocolError(f"{head.name} carries {head.body - 4 * len(ids)} value bytes, expected {expected}")
        return ids.tolist()

    def _read_values(self, ch: P.Channel, ids: list[int], into: torch.Tensor) -> None:
        flat = into.numpy()
        for i in ids:
            ch.recv_into(flat[self.offsets[i]: self.offsets[i] + self.numel_of[i]])

    def _on_init(self, w: int, ch: P.Channel, head) -> None:
        with self._cond:
            if w != 0 or self._initialized:
                raise ProtocolError(f"worker {w} sent INIT, but {'only worker 0 may' if w else 'the shard is set'}")
        self._read_values(ch, self._read_ids(ch, head, exact_all=True), self.params)
        with self._cond:
            self._initialized = True
            self._cond.notify_all()

    def _on_push(self, w: int, ch: P.Channel, head) -> None:
        with self._cond:
            if not self._initialized:
                raise ProtocolError(f"worker {w} pushed before the shard was initialized")
            want = self.version if self.cfg.synchronous else self._clock[w]
            if head.step != want:
                raise MismatchError(f"worker {w} pushed step {head.step}, this server expects step {want}")
            if head.version > self.version:
                raise ProtocolError(f"worker {w} claims parameters of version {head.version}, newer than {self.version}")
        got = self._got[w]
        ids = self._read_ids(ch, head, exact_all=False)
        if got.intersection(ids):
            raise ProtocolError(f"worker {w} pushed a partition twice for step {head.step}")
        self._check_lr(w, head, P.lr_of(head, f"worker {w}"))
        if not self.cfg.synchronous:
            self._read_values(ch, ids, self._grads[w])
            got.update(ids)
            self._took(w, head, ids)
            return
        run, nbytes = [], 0
        for k, i in enumerate(ids):  # each run of partitions counts the moment it is in: it may complete now
            self._read_values(ch, [i], self._grads[w])
            run.append(i)
            nbytes += 4 * self.numel_of[i]
            if nbytes >= STEP_RUN_BYTES or k == len(ids) - 1:
                got.update(run)
                self._took(w, head, run)
                run, nbytes = [], 0

    def _check_lr(self, w: int, head, lr: float) -> None:
        """Every message of one step carries the same learning rate: synchronous, every worker's
        (the step is one SGD step over their mean gradient); asynchronous, each worker's own."""
        if not self.cfg.synchronous:
            if not self._got[w]:  # (the first message of its step)
                self._lr_of[w] = lr
            elif self._lr_of[w] != lr:
                raise ProtocolError(f"worker {w} pushed step {head.step} with learning rates {self._lr_of[w]} and {lr}")
            return
        with self._cond:
            if self._step_lr is None:
                self._step_lr = (lr, w)
            elif self._step_lr[0] != lr:
                first, u = self._step_lr
                raise MismatchError(
                    f"worker {w} pushed step {head.step} with learning rate {lr}, worker {u} with {first}: "
                    "synchronous workers take each step with the same learning rate (set it alike on every "
                    "worker, e.g. the same scheduler stepped once per step())")

    def _took(self, w: int, head, ids: list[int]) -> None:
        """Worker w's gradients of ``ids`` are in its staging buffer: count or apply them."""
        got = self._got[w]
        with self._cond:
            self._check_failed()  # a failed job applies nothing more
            whole = len(got) == len(self.shard_ids)
            if whole:
                got.clear()
                self._clock[w] += 1
            if self.cfg.synchronous:
                self._complete[w] = self._complete[w] or whole
                self._take_sync(ids)
            elif whole:
                self.staleness[self.version - head.version] += 1
                mine = self._grads[w]
                self._apply(self.shard_ids.tolist(), lambda i: self._slice(mine, i) / self.cfg.workers,
                            self._lr_of[w])
                self.version += 1
                self.updates += 1
            self._cond.notify_all()

    def _take_sync(self, ids: list[int]) -> None:
        """Count one worker's gradients of ``ids``; step and stream the partitions now complete (caller holds lock)."""
        W = self.cfg.workers
        ready = []
        for i in ids:
            self._count[i] += 1
            if self._count[i] == W:
                self._count[i] = 0
                ready.append(i)
        if not ready:
            return
        for i in ready:  # what a rollback restores
            view = self._views[i]
            self._undo[i] = (view.clone(), self._copy_state(view))
        self._apply(ready, lambda i: sum_in_order([self._slice(g, i) for g in self._grads]).div_(W),
                    self._step_lr[0])
        step = self.version + 1
        for i in ready:
            self._part_version[i] = step
        ready.sort(key=self.offsets.__getitem__)
        now = time.monotonic()
        for u, outbox in self._outboxes.items():
            if self._want[u] == step and self._status[u] == "connected":
                outbox.put(("params", step, ready))
                self._heard[u] = now  # (it waited for these: its silence counts from now, not from its pull)
        if len(self._undo) == len(self.shard_ids):  # every partition has taken step `version`
            # (kept for a SAVE that comes after the step: only where the server can save)
            self._prev, self._undo = (self._undo if self.cfg.shard_dir else {}), {}
            self._complete = [False] * W
            self._step_lr = None
            self.version = step
            self.updates += 1

    def _slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i]: self.offsets[i] + self.numel_of[i]]

    def _apply(self, ids: list[int], grad_of, lr: float) -> None:
        """One optimizer step at learning rate ``lr`` on partitions ``ids``, partition i's gradient
        ``grad_of(i)`` (caller holds the lock)."""
        views = [self._views[i] for i in ids]
        for i, view in zip(ids, views):
            view.grad = grad_of(i)
        # torch's own step, over these partitions only: SGD.step (Adam's too) walks every parameter
        # of its group, and a synchronous server steps partition by partition as they complete, so
        # a shard of thousands of small tensors took time quadratic in their number. (The state is
        # keyed by tensor: momentum buffers, Adam's moments stay where they are.)
        group = self.opt.param_groups[0]
        every = group["params"]
        group["params"], group["lr"] = views, lr
        try:
            self.opt.step()
        finally:
            group["params"] = every
        for view in views:
            view.grad = None

    def _copy_state(self, view: torch.Tensor) -> dict:
        """A copy of the optimizer's state of one partition, whatever its entries (SGD's momentum
        buffer; Adam's exp_avg, exp_avg_sq and step): torch updates them in place, so a record of
        the tensors themselves would hold the step it is meant to undo. {}: none yet."""
        return {key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in self.opt.state.get(view, {}).items()}

    def _rollback(self) -> None:
        """Put back every partition that took the unfinished step (caller holds the lock)."""
        for i, (values, state) in self._undo.items():
            view = self._views[i]
            view.copy_(values)
            if state:
                self.opt.state[view] = state
            else:  # (its first step: torch makes the state afresh at the next)
                self.opt.state.pop(view, None)
            self._part_version[i] = self.version
        if self._undo:
            log.warning("%s rolled %d partitions back to version %d", self.name, len(self._undo), self.version)
        self._undo.clear()
        self._count = dict.fromkeys(self._count, 0)
        self._step_lr = None

    def _on_pull(self, w: int, ch: P.Channel, head) -> None:
        if head.body:
            raise ProtocolError(f"worker {w} sent a PULL with a body")
        if self.cfg.synchronous:
            self._wait_until(w, lambda: None if self._initialized else "the shard was never initialized by worker 0")
            with self._cond:
                if head.step not in (self.version, self.version + 1):
                    raise MismatchError(f"worker {w} pulls step {head.step}, but this server is at step {self.version}")
                self._want[w] = head.step
                ready = [i for i in self.shard_ids.tolist() if self._part_version[i] >= head.step]
                if ready:
                    self._outboxes[w].put(("params", head.step, ready))
                self._check_stuck()
            return
        with self._cond:
            ticket = self._pulls_seen
            self._pulls_seen += 1
        self._wait_until(w, lambda: self._pull_blocker(w, head.step), lambda: self._behind(w, head.step))
        self._answer_in_turn(ch, w, head.step, ticket)

    def _answer_in_turn(self, ch: P.Channel, w: int, step: int, ticket: int) -> None:
        """Async: send worker w the whole shard once the answers due before it are on the wire.

        One answer at a time, in the order the pulls came (``ticket``): the first worker has its
        parameters after one shard's time on the server's link and computes, and pushes its next
        gradients, while the next one's go out. Sent side by side, every answer would end only
        when all had (with ``max_staleness`` 0 the pulls of a step are answered together, so
        pushes in and pulls out would take turns on the full-duplex link instead of overlapping).
        A turn that does not come within ``timeout`` (an answer stuck on a worker that stopped
        reading, until its own timeout loses it) is not waited for: the answer goes out beside it.
        The values are those at the turn, with their version."""
        deadline = time.monotonic() + self.cfg.timeout
        mine = False
        try:
            with self._cond:
                self._serving.add(w)  # (waiting for this server is not silence)
                self._turns.append(ticket)
                try:
                    while self._answering or min(self._turns) != ticket:
                        self._check_failed()
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(min(left, 1.0))
                finally:
                    self._turns.remove(ticket)
                mine = not self._answering  # (False: the turn did not come: this answer goes beside it)
                self._answering = True
                version = self.version
                live = sum(s != "lost" for s in self._status)
                if mine:  # (one answer in turn at a time: its copy reuses one buffer, no fresh pages per pull)
                    if self._turn_copy is None:
                        self._turn_copy = torch.empty_like(self.params)
                    snapshot = self._turn_copy.copy_(self.params)
                else:
                    snapshot = self.params.clone()
            self._send_params(ch, w, step, version, live, self.shard_ids.tolist(), snapshot)
        finally:
            with self._cond:
                if mine:
                    self._answering = False
                self._serving.discard(w)
                self._heard[w] = time.monotonic()
                self._cond.notify_all()

    def _wait_until(self, w: int, blocker, holding_up=None) -> None:
        """Wait until ``blocker()`` (called under the lock) says nothing blocks; fail a sync job on timeout.
        At the deadline, absent workers among ``holding_up()`` are lost first (_drop_absent). A wait
        on a worker still to connect is no silence: it lasts until ``timeout`` after that worker
        connected, or until serve() loses it (``join_timeout`` after the first connected)."""
        deadline = time.monotonic() + self.cfg.timeout
        with self._cond:
            self._serving.add(w)
            try:
                self._wait_locked(w, blocker, holding_up, deadline)
            finally:
                self._serving.discard(w)
                self._heard[w] = time.monotonic()  # (its silence counts from the end of its wait here, not before)

    def _wait_locked(self, w: int, blocker, holding_up, deadline: float) -> None:
        while True:
            self._check_failed()
            why = blocker()
            if why is None:
                return
            now = time.monotonic()
            if self._joining_holds_up(holding_up):  # (serve() loses it at join_timeout; once in, it has the timeout)
                deadline = max(deadline, now + self.cfg.timeout)
            if self._served_holds_up(w, holding_up):  # (waiting for this server is no silence: not to be lost for it)
                deadline = max(deadline, now + self.cfg.timeout)
            left = deadline - now
            if left <= 0:
                self._drop_absent(now, holding_up() if holding_up else ())
                if blocker() is None:
                    return
                err = CommTimeout(f"{self.name}: {why} after {self.cfg.timeout:g} s")
                if self.cfg.synchronous:
                    self._fail(err)
                raise err
            self._cond.wait(min(left, 1.0))

    def _joining_holds_up(self, holding_up) -> bool:
        """Whether a worker that has not connected yet is among those this wait waits for (caller
        holds the lock): sync, one whose gradients of the step are missing, or worker 0 before its
        INIT; async, one of ``holding_up()``."""
        waiting = {u for u, status in enumerate(self._status) if status == "waiting"}
        if not waiting:
            return False
        if not self._initialized:
            return 0 in waiting
        if self.cfg.synchronous:
            return not waiting.isdisjoint(self._missing())
        return holding_up is not None and not waiting.isdisjoint(holding_up())

    def _served_holds_up(self, w: int, holding_up) -> bool:
        """Async: whether one of ``holding_up()`` waits for this server itself (caller holds the lock):
        for its answer's turn behind a slow reader, which may take ``timeout`` (``_answer_in_turn``).
        _drop_absent leaves such a worker alone, so the wait on it lasts until it is answered, and its
        silence counts from then."""
        return holding_up is not None and any(u in self._serving for u in holding_up() if u != w)

    def _check_stuck(self) -> None:
        """Sync: fail if the step in progress waits for a worker that has left (caller holds lock)."""
        waiting = any(self._want[u] == self.version + 1 and self._status[u] == "connected"
                      for u in range(self.cfg.workers))
        gone = [u for u in self._missing() if self._status[u] in ("bye", "lost")]
        if waiting and gone:
            self._fail(PeerLost(f"{self.name}: step {self.version} cannot complete: worker(s) "
                                f"{gone} left the job before pushing it"))

    def _on_bye(self, w: int, outbox: queue.Queue, sender: threading.Thread) -> None:
        """Answer BYE after everything this worker's last pull streams (sync), then let serve() end.
        A worker that says BYE before its push of the step is whole (its script raised during backward,
        and close() ran) holds that step up itself: it is answered at once and the step fails now
        (_check_stuck), where waiting for the step would have waited out the timeout."""
        if self.cfg.synchronous:
            want = self._want[w]
            self._wait_until(w, lambda: None if want is None or self.version >= want or not self._complete[w]
                             else f"step {self.version} has no complete gradient from worker(s) {self._missing()}")
        outbox.put(("bye",))
        sender.join(self.cfg.timeout)
        with self._cond:  # only now: serve() may return (and the process exit) after this
            self._status[w] = "bye"
            if self.cfg.synchronous:
                self._check_stuck()
            self._cond.notify_all()

    def _missing(self) -> list[int]:
        return [u for u in range(self.cfg.workers) if not self._complete[u]]

    def _pull_blocker(self, w: int, step: int) -> Optional[str]:
        """Async: why worker w's pull at its step ``step`` cannot be answered yet (None: it can)."""
        if not self._initialized:
            return "the shard was never initialized by worker 0"
        behind = self._behind(w, step)
        if not behind:
            return None
        slowest = min(self._clock[u] for u in behind)
        return (f"worker {w} is {step - slowest} steps ahead of worker(s) {behind} "
                f"(max_staleness {self.cfg.max_staleness})")

    def _behind(self, w: int, step: int) -> list[int]:
        """Async: the live workers more than max_staleness steps behind worker w at ``step``."""
        if self.cfg.max_staleness is None:
            return []
        return [u for u, s in enumerate(self._status)
                if s in ("connected", "waiting") and u != w and step - self._clock[u] > self.cfg.max_staleness]

    def _on_save(self, w: int, ch: P.Channel, head) -> None:
        """Checkpoint the shard as it was at step ``head.step`` and answer SAVED (``extra`` 1: once
        the shard is copied, written in the background); a save that cannot be made is answered
        with the reason (SAVED, extra 1) and serving goes on."""
        if head.body:
            raise ProtocolError(f"worker {w} sent a SAVE with a body")
        if head.step < 0:
            raise ProtocolError(f"worker {w} asked for a checkpoint of step {head.step}")
        if head.extra not in (0, 1):
            raise ProtocolError(f"worker {w} sent a SAVE with extra {head.extra} (0: written, 1: in the background)")
        try:
            if self.cfg.shard_dir is None:
                raise _SaveRefused(f"{self.name} was started without a checkpoint directory, so it cannot save "
                                   f"step {head.step}: start the servers with one")
            if self.cfg.synchronous:
                self._wait_until(w, lambda: None if self.version >= head.step
                                 else f"step {head.step} was not reached for a checkpoint")
            self._save(head.step, background=bool(head.extra))
        except _SaveRefused as exc:
            log.error("%s", exc)
            ch.send(P.SAVED, worker=w, step=head.step, version=self.version, extra=1,
                    body=P.encode_json({"error": str(exc)}))
            return
        ch.send(P.SAVED, worker=w, step=head.step, version=head.step if self.cfg.synchronous else self.version)

    def _save(self, step: int, background: bool = False) -> None:
        """Write the checkpoint of ``step`` (see *checkpoint of step s* above), or only start to in the
        ``background``; _SaveRefused if it cannot be, or if the background write before it failed."""
        with self._save_lock:
            self._save_locked(step, background)

    def _save_locked(self, step: int, background: bool) -> None:
        try:  # (one write in flight at most, and in the background one more queued behind it)
            self._writer.wait(at_most=1 if background else 0)
        except OSError as exc:
            raise _SaveRefused(f"{self.name} could not write an earlier checkpoint to {self.cfg.shard_dir} in the "
                               f"background ({exc}), so step {step} is not saved either") from None
        with self._cond:
            version, params, state = self._state_at(step) if self.cfg.synchronous else self._state_now()
            payload = {
                "server": self.cfg.index,
                "servers": self.cfg.servers,
                "layout": self.layout.digest(),
                # (the model and partition size: a job with another number of servers cuts the shards anew)
                "numels": list(self.layout.numels),
                "shapes": self._settings["shapes"],
                "partition_bytes": self.layout.partition_bytes,
                "strategy": self.cfg.strategy,
                "version": version,
                # Every worker resumes at `step`: synchronous, the shard's step (a worker that pushed
                # step `step` already, whole or in part, pushes it again); asynchronous, the saving
                # worker's, on every server alike (their counts of the others differ from server to
                # server while the save goes round).
                "clocks": [step] * self.cfg.workers,
                "params": params,
                "optimizer": self._settings["optimizer"],
                "optimizer_state": state,
                # (the same tensor, stored once: a server from before Adam resumes an SGD checkpoint)
                "momentum": state["elements"].get("momentum_buffer"),
                "staleness": {str(k): v for k, v in self.staleness.items()},
            }
        try:
            # (_state_at/_state_now copied the shard under the lock: the write needs no lock, nor another copy)
            self._writer.save(step, payload, wait=not background, copied=True)
            if not background:
                self._writer.wait()
        except OSError as exc:
            raise _SaveRefused(f"{self.name} could not write the checkpoint of step {step} to "
                               f"{self.cfg.shard_dir}: {exc}") from None

    def _state_now(self) -> tuple[int, torch.Tensor, dict]:
        """Version, values and optimizer state of the shard as they are (caller holds the lock)."""
        return self.version, self.params.clone(), self._optimizer_state({})

    def _state_at(self, step: int) -> tuple[int, torch.Tensor, dict]:
        """Sync: version, values and optimizer state of the shard at version ``step`` (caller holds the lock).

        A SAVE of step s comes after the saving worker's pushes of step s-1 and before those of
        step s+1, so the shard is at version s, with some partitions perhaps stepped past it
        already (``_undo`` has their values before), or at version s+1 (``_prev`` has every
        partition's values before it)."""
        if self.version == step:
            before = self._undo
        elif self.version == step + 1 and len(self._prev) == len(self.shard_ids):
            before = self._prev
        else:
            raise _SaveRefused(f"{self.name} cannot save step {step}: it is at step {self.version}")
        params = self.params.clone()
        for i, (values, _) in before.items():
            params[self.offsets[i]: self.offsets[i] + self.numel_of[i]].copy_(values)
        return step, params, self._optimizer_state(before)

    def _optimizer_state(self, before: dict) -> dict:
        """The optimizer's state of the whole shard, partition i's from ``before[i]`` where given, copied:
        ``{"elements": {key: tensor}, "partitions": {key: tensor}}``. An entry of one value per element
        (a momentum buffer, exp_avg) is the partitions' entries one after the other, as the values are
        (numel of the shard); one of one value per partition (Adam's step), theirs stacked (one per
        partition, in the shard's order). An entry not every partition has is left out (none has any
        before its first step: every partition takes every step)."""
        states = [before[i][1] if i in before else self.opt.state.get(view, {}) for i, view in self._views.items()]
        out: dict = {"elements": {}, "partitions": {}}
        for key in states[0] if states else ():
            entries = [state.get(key) for state in states]
            if not all(isinstance(e, torch.Tensor) for e in entries):
                continue
            if all(e.shape == view.shape for e, view in zip(entries, self._views.values())):
                out["elements"][key] = torch.cat([e.reshape(-1) for e in entries])
            elif all(e.dim() == 0 for e in entries):
                out["partitions"][key] = torch.stack(entries)
            else:
                raise _SaveRefused(f"{self.name} cannot save its optimizer's state {key!r}: of neither one value per "
                                   "element nor one per partition")
        return out


def _tell_all(channels: list, error: CommError) -> None:
    for ch in channels:
        ch.send_abort(error)


def sum_in_order(grads: list[torch.Tensor]) -> torch.Tensor:
    """grads[0] + grads[1] + ... in that order (the reduction order the contract names)."""
    total = grads[0].clone()
    for g in grads[1:]:
        total.add_(g)
    return total


def run_server(cfg: ServerConfig, ready=None) -> dict:
    """Make a server, report its endpoint through ``ready(endpoint)``, serve; return its stats.

    Raises the server's failure (a CommError) after serving if the job failed, or the error of its
    last checkpoint's write in the background (a CheckpointWriteError).
    """
    server = ParameterServer(cfg)
    if ready is not None:
        ready(server.endpoint)
    stats = server.serve()
    if server.failed is not None:
        raise server.failed
    if server.write_error is not None:
        raise server.write_error
    return stats


def _first_difference(theirs: list[list[int]], ours: list[list[int]]) -> str:
    """Where a worker's parameter shapes first differ from the first worker's, for the HELLO refusal
    (the server knows sizes and shapes only: parameters are numbered as the worker serves them)."""
    if len(theirs) != len(ours):
        what = f"it has {len(theirs)} parameters that require a gradient, the first worker {len(ours)}"
    else:
        i = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
        if i is None:
            return ""
        a, b = theirs[i], ours[i]
        where = f"its parameter #{i} (counting those of module.parameters() that require a gradient) has"
        if math.prod(a) != math.prod(b):
            what = (f"{where} {math.prod(a)} elements, the first worker's {math.prod(b)} (shapes {format_shape(a)} "
                    f"and {format_shape(b)})")
        else:
            what = f"{where} shape {format_shape(a)}, the first worker's {format_shape(b)}"
    return (f": {what}. Every worker must wrap the same model, with the same parameters requiring a gradient")
