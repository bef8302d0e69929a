"""The worker side: wrap a module so that its gradients go to parameter servers and its
parameters come back from them, with the feel of DistributedDataParallel.

    ps = ParameterServerTraining(model, servers=endpoints, worker=w, workers=W,
                                 strategy="sync", lr=0.05, momentum=0.9)
    for x, y in batches:
        loss = model.loss(ps(x), y)
        loss.backward()       # gradients are pushed group by group while backward runs
        ps.step()             # push what is left, ask every server for the next parameters
    ps.close()                # BYE to every server; ps.stats() has bytes and staleness

Words (layout words are ``sharding.py``'s, message words ``protocol.py``'s):

- *group*: consecutive parameters in backward order whose gradients go out together, as the
  merge planner (``ringtrain.plan.merge``, the same as the allreduce path) decides from the
  backward timings measured in the first step (which pushes every parameter on its own). When a
  group's last gradient is accumulated (a post-accumulate-grad hook), its partitions are queued
  for each server that owns some of them; one *sender* thread per server writes them, so
  backward never waits for the network and every server is written to at once.
- *pull*: every server is asked for the parameters of the next step; one *receiver* thread per
  server writes the values straight into the parameters' memory as they arrive. Synchronous:
  the pull for step t+1 goes out before the first push of step t, and a server streams each
  partition the moment it has stepped it (the last layers first, while the first layers'
  gradients are still being pushed); a parameter is written only after its own gradient hook
  has fired, when backward no longer reads it. Asynchronous: the pull follows the pushes and
  is answered with the whole shard. A forward pre-hook on each module waits only for that
  module's own parameters (``overlap_pull``); one on the root waits for the *read-outside*
  ones: parameters that got a gradient in a step where no module owning them was called (read
  by another module, ``F.linear(x, self.a.weight)``, or held in an ``nn.ParameterList``), as the
  first step finds them (its forward waits for every parameter). One found later is logged: its
  value in that step may have been the one before the pull.
- The optimizer lives on the servers (``PSOptions.optimizer``: SGD, Adam or AdamW): do not step a
  local optimizer; ``step()`` also clears the gradients (set to None). ``optimizer`` is the
  servers' optimizer as torch sees it (``server_optimizer.ServerOptimizer``: its ``step()`` is
  ``step()``; torch's schedulers set its learning rate, which every push of a step carries, read
  at the step's forward: the first through this wrapper that tracks gradients, or else at its
  first push). A parameter that
  got no gradient is pushed as zeros; a ``step()`` with no gradient at all (no backward since
  the last) is refused, pushing nothing.
- *version*: a tensor's in-place write counter (``Tensor._version``). The receiver writes
  through numpy views, which leave it alone, so a parameter whose version moved was written by
  the caller (a local ``optimizer.step()``, ``load_state_dict``): ``step()`` refuses it, as it
  refuses a gradient whose version moved after its push.

Every wait ends by ``timeout`` (a wait for pulled parameters by twice that, so that a server
can first drop a silent worker that holds the pull up, and say so), but for joining, where
start-up counts: reaching the servers and their answer to HELLO end by ``join_timeout``, and
while other workers may still be connecting (up to the step whose pull waits for every worker
to have pushed once: the first for a synchronous job, the staleness bound's + 1 for an
asynchronous one, as the servers' WELCOME gives it) a wait ends no earlier than
``join_timeout`` + 2 × ``timeout`` after this worker connected: the servers wait
``join_timeout`` for a worker to connect. A lost server is a
PeerLost naming it, raised by the next forward, ``step()``, ``wait()`` or ``close()``; an error
a server reports (a lost worker in a synchronous job) comes back with the server's text.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import warnings
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .. import plan as planner
from ..collectives.ops import check_cpu_module, numpy_of
from ..errors import CommError, CommTimeout, MismatchError, PeerLost, ProtocolError, check_keywords, check_number
from . import protocol as P
from .server_config import OPTIMIZER_DEFAULTS, STRATEGIES, JoinTimeout
from .server_optimizer import OPTIMIZERS, ServerOptimizer
from .sharding import Partition, make_layout

log = logging.getLogger(__name__)
_by_id = attrgetter("id")


#: Seconds that close(), and the interpreter's exit for a worker never closed, wait for the link
#: threads to end (all of them together; a shut-down channel ends each at once).
JOIN_S = 5.0
#: Seconds a sender whose send failed (the server closed the connection) gives the link's
#: receiver to read what the server said before closing it (an ABORT: why the job failed), so
#: that reason, not "broken pipe", is the worker's error.
REASON_GRACE_S = 1.0

#: The end of every refusal of step() after this step's pushes went out: what else there is.
RETRY_NOTE = (" (synchronous servers wait for it up to their timeout, then lose this worker and end the job; or "
              "close() and resume a new ParameterServerTraining from the last checkpoint)")


@dataclass(kw_only=True, slots=True, frozen=True)
class PSOptions(JoinTimeout):
    """Settings of one worker's side of parameter-server training (servers get theirs at launch).

    Frozen: the optimizer and its settings but lr (momentum, betas, eps, weight_decay) reach the
    servers in the first HELLO and stay for the run; lr is the learning rate to start with
    (``ParameterServerTraining.optimizer`` changes it from step to step: each push carries its step's)."""

    strategy: str = "sync"
    """'sync', 'sharded' (sync over several servers) or 'async'; must match the servers'."""
    optimizer: str = "sgd"
    """What the servers apply: 'sgd' (torch.optim.SGD), 'adam' or 'adamw' (torch.optim.Adam, AdamW);
    its state (momentum buffers, Adam's moments and step) lives on the servers."""
    lr: float = 0.05
    """Learning rate to start with (applied on the servers; ``optimizer``'s param group changes it)."""
    momentum: float = 0.9
    """SGD momentum (its buffer lives on the servers); not used by Adam and AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's and AdamW's coefficients of the running averages; not used by SGD."""
    eps: float = 1e-8
    """Adam's and AdamW's term added to the denominator; not used by SGD."""
    weight_decay: float = 0.0
    """Weight decay: SGD's and Adam's added to the gradient, AdamW's decoupled (0 here for every
    optimizer, though torch's AdamW defaults to 0.01: set it)."""
    schedule: str = "optimal"
    """How gradients are merged into pushes during backward (ringtrain.plan.METHODS)."""
    bucket_cap_mb: float = 25.0
    """Size threshold of a push in MiB for ``schedule="fixed"`` (as DistributedDataParallel's)."""
    alpha: float = 1e-4
    """Start-up cost of one push, seconds (the planner's alpha)."""
    beta: float = 8e-9
    """Seconds per byte of a push (the planner's beta; 8e-9 = 1 Gbit/s)."""
    partition_mb: float = 4.0
    """Largest partition of one parameter, MiB."""
    overlap_pull: bool = True
    """Let the next forward start as soon as its own layers' parameters arrived."""
    timeout: float = 60.0
    """Seconds any wait may last."""
    join_timeout: Optional[float] = None
    """Seconds to join, where start-up counts: for the servers' endpoints in the job's store
    (``worker_from_env``), each server's handshake and answer to HELLO (the first HELLO sets up
    its shard), and the waits on workers still connecting (module docstring); None: ``timeout``,
    but at least 60 (``ringtrain.init``'s rule)."""
    job: str = "ps"
    """Job name (the servers' must be the same)."""
    secret: Optional[bytes] = field(default=None, repr=False)
    """The job's shared secret, as the servers'."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.schedule not in planner.METHODS:
            raise ValueError(f"schedule must be one of {planner.METHODS}, got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        betas = tuple(check_number("betas", b, positive=False) for b in betas)
        if not all(b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", betas)
        for name in ("lr", "timeout", "partition_mb", "bucket_cap_mb", "momentum", "weight_decay", "eps", "alpha",
                     "beta"):
            value, positive = getattr(self, name), name in ("lr", "timeout", "partition_mb", "bucket_cap_mb")
            # (the servers refuse a HELLO whose lr, momentum or weight_decay is not finite; a float,
            # not a numpy scalar, goes into the HELLO's JSON)
            object.__setattr__(self, name, check_number(name, value, positive=positive))
        if self.join_timeout is not None:
            object.__setattr__(self, "join_timeout", check_number("join_timeout", self.join_timeout, unit=" of seconds"))

    @property
    def partition_bytes(self) -> int:
        return max(4, int(self.partition_mb * (1 << 20)) // 4 * 4)


def _staleness_of(welcome: dict, peer: str) -> Optional[int]:
    """The staleness bound a server's WELCOME gives (0 where it gives none: a synchronous server)."""
    bound = welcome.get("max_staleness", 0)
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
        raise ProtocolError(f"{peer} sent a WELCOME whose 'max_staleness' is not an integer >= 0 or null, "
                            f"got {str(bound)[:80]}")
    return bound


class _Link:
    """One server: its channel, sender queue and threads, and what came back."""

    def __init__(self, k: int, ch: P.Channel):
        self.k = k
        self.ch = ch
        self.jobs: queue.Queue = queue.Queue()
        self.version = 0  # of the last parameters pulled
        self.clock = 0  # this worker's steps as the server counts them (from WELCOME)
        self.max_staleness: Optional[int] = 0  # the server's bound (from WELCOME; None: unbounded)
        self.saved = -1
        self.save_error: Optional[str] = None  # why the server could not save (SAVED with extra 1)
        self.bye: Optional[dict] = None
        self.threads: list[threading.Thread] = []
        self.received_all = threading.Event()  # set when the receiver ends (it has read what came)


def _stop_links(links: list[_Link], *, close: bool = True) -> None:
    """End the links' threads: a sentinel wakes each sender (what it has not sent yet is dropped),
    shutting its channel down wakes the receiver (and a sender blocked on a full socket); then
    wait, up to ``JOIN_S`` in all.

    ``close=False``: the interpreter's exit for a worker never closed (a script that raised; the
    finalizer made in __init__). The threads are daemons, and one still inside torch when Python
    finalizes is cut off there, which aborts the process ("terminate called without an active
    exception", SIGABRT, after the script's own traceback) instead of letting it exit with its
    status; atexit callbacks, weakref.finalize's among them, run before that. Only reading is shut
    down: the servers hear of this worker when the process has ended, as before, not while it
    still finalizes (then another worker, told by a synchronous server, could fail first and a
    launcher report that failure and stop this process)."""
    for link in links:
        try:
            while True:
                link.jobs.get_nowait()
        except queue.Empty:
            pass
        link.jobs.put(None)
        if close:
            link.ch.close()
        else:
            link.ch.shut_reading()
    deadline = time.monotonic() + JOIN_S
    here = threading.current_thread()  # (a worker collected on one of its own link threads: not waited for)
    for link in links:
        for t in link.threads:
            if t is not here:
                t.join(max(0.0, deadline - time.monotonic()))


def _let_go(handles: list, links: list[_Link]) -> None:
    """A worker never closed, collected or at the interpreter's exit: its hooks off the module,
    its links' threads ended (``_stop_links(close=False)``; a thread that finds the worker
    collected closes its link's connection, ``_link_loop``)."""
    for h in handles:
        h.remove()
    handles.clear()
    _stop_links(links, close=False)


def _call(me: weakref.ref, name: str, *args: Any) -> Any:
    """Method ``name`` of the worker ``me`` holds weakly (a hook on the user's module, which must
    not keep a worker alive); nothing once it is gone."""
    worker = me()
    return None if worker is None else getattr(worker, name)(*args)


def _link_loop(me: weakref.ref, link: _Link, sending: bool) -> None:
    """A link's sender or receiver thread. It holds the worker weakly while it waits (for a job
    to send, or a message to read), so that a worker dropped unclosed is collected and its
    finalizer ends the thread; held by its threads, such a worker kept them, its connections
    and its hooks on the module for ever."""
    try:
        while True:
            item = link.jobs.get() if sending else _next_header(link)
            worker = me()
            if worker is None:  # collected unclosed (its finalizer woke this thread): the connection goes now
                link.ch.close()
                return
            if item is None:
                return
            if not (worker._send(link, item) if sending else worker._receive(link, item)):
                return
            del worker
    finally:
        if not sending:
            link.received_all.set()


def _next_header(link: _Link) -> Any:
    """The next message's header from ``link``'s server, or the exception reading it raised."""
    try:
        return link.ch.recv_header(None)
    except (EOFError, CommError, OSError) as exc:
        return exc


class ParameterServerTraining:
    """Train ``module`` against parameter servers; see the module docstring for the loop."""

    def __init__(self, module: nn.Module, *, servers: Sequence[Sequence], worker: int, workers: int,
                 options: Optional[PSOptions] = None, **settings: Any):
        check_keywords("ringtrain.ps.ParameterServerTraining", settings,
                       (f.name for f in dataclasses.fields(PSOptions)))
        opts = options or PSOptions(**settings)
        if options is not None and settings:
            raise ValueError(f"pass either options or keyword settings, not both (got {sorted(settings)})")
        servers = _endpoints(servers)
        if not 0 <= worker < workers:
            raise ValueError(f"worker must be in [0, workers={workers}), got {worker}")
        check_cpu_module(module, "ringtrain.ps.ParameterServerTraining")
        sparse = [name or type(m).__name__  # (the wrapped module itself has the name '': its class instead)
                  for name, m in module.named_modules() if getattr(m, "sparse", False) is True
                  and any(p.requires_grad for p in m.parameters(recurse=False))]  # (a frozen one makes none)
        if sparse:  # (nn.Embedding / nn.EmbeddingBag(sparse=True): the gradients would be sparse tensors)
            raise ValueError(f"ringtrain.ps.ParameterServerTraining pushes dense gradients only, and {sparse} "
                             "make sparse ones: construct them with sparse=False")
        self.module, self.opts, self.worker, self.workers = module, opts, worker, workers
        self.num_servers = K = len(servers)
        self.params = _unique_params(module)
        if not self.params:
            raise ValueError("ringtrain.ps.ParameterServerTraining: the module has no parameter that requires a "
                             "gradient, so the servers would have nothing to train")
        self._versions = [p._version for p in self.params]  # nothing of ours writes them in place
        names = {id(p): n for n, p in module.named_parameters()}
        self._names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(self.params)]
        served = {id(p) for p in self.params}
        self._unserved = [(n, p) for n, p in module.named_parameters() if id(p) not in served]  # frozen ones
        self.layout = make_layout([p.numel() for p in self.params], K, opts.partition_bytes)
        self._shards = [self.layout.shard(k) for k in range(K)]
        self._ids = [np.array([p.id for p in s], dtype=np.int64) for s in self._shards]
        # Each parameter's partitions, in (start) order: one pass (layout.of_param walks them all).
        self._pieces: list[list[Partition]] = [[] for _ in self.params]
        for part in self.layout.partitions:
            self._pieces[part.param].append(part)
        # Param i is in for step t once each of its partitions arrived for a pull of step >= t.
        self._parts_of = [[p.id for p in pieces] for pieces in self._pieces]
        self._arrived = [-1] * len(self.layout.partitions)  # step of the pull each partition last came with
        self._part = {p.id: p for p in self.layout.partitions}
        self._cond = threading.Condition()
        self._error: Optional[CommError] = None
        self._closed = False
        self.notices: list[str] = []
        self._live = workers
        self._pulled = -1  # step of the last pull issued to every server
        # Until calibrated, one push after backward: the first step's hooks time backward alone,
        # the plan's input (pushed one by one, each push's work went into the gaps measured:
        # 3,000 small parameters were planned into ~900-1,300 pushes a step).
        self._groups: list[list[int]] = [list(range(len(self.params)))]
        self._calibrated = False
        self._stamps: dict[int, float] = {}
        self._handles: list = []
        self._called: set[int] = set()  # ids of the modules a forward called since the last step()
        self._outside: list[int] = []  # the read-outside parameters (module docstring)
        self._found_outside = False  # the first step() has looked for them
        self.pull_wait_s = 0.0  # time forward (or wait()) spent blocked on pulled parameters
        self._pushed_grads: list[tuple[int, torch.Tensor, int]] = []  # (param, gradient, its _version) sent
        self.optimizer = ServerOptimizer(self.params, self._step, worker, optimizer=opts.optimizer, lr=opts.lr,
                                         momentum=opts.momentum, betas=opts.betas, eps=opts.eps,
                                         weight_decay=opts.weight_decay)
        self._step_lr: Optional[float] = None  # the learning rate this step's pushes carry (from its forward)
        self._links = self._connect(servers)
        # Stops the link threads at exit where close() never came (_stop_links).
        self._at_exit = weakref.finalize(self, _let_go, self._handles, self._links)
        # (until then a wait may be on a worker still connecting: _deadline)
        self._joining_until = time.monotonic() + self.opts.join_s + 2 * self.opts.timeout
        try:
            self.step_count = self._agreed_clock()
            # The last step whose pull may wait for a worker still connecting: the first (worker 0's
            # INIT), and while the staleness bound lets no worker run further ahead of one at step
            # 0 (synchronous: bound 0, the first step's pull); none with no bound.
            bounds = [link.max_staleness for link in self._links]
            self._joined_after = self.step_count + (0 if None in bounds else max(bounds) + 1)
            for link in self._links:
                for role in ("_sender", "_receiver"):
                    t = threading.Thread(target=_link_loop, args=(weakref.ref(self), link, role == "_sender"),
                                         daemon=True, name=f"ps-w{worker}-s{link.k}-{role}")
                    t.start()
                    link.threads.append(t)
            self._reset_groups()
            self._install_hooks()
            self._issue_pulls(self.step_count)
            if not opts.overlap_pull:
                self.wait()
        except BaseException:  # leave no hooks on the module, no threads, no open connections
            self._release()
            raise

    # --- set-up ---------------------------------------------------------------------------------
    def _connect(self, servers: Sequence[Sequence]) -> list[_Link]:
        K, W, opts = self.num_servers, self.workers, self.opts
        me = P.ps_identity(K + self.worker, K + W, opts.job, opts.secret)
        hello = {"worker": self.worker, "numels": list(self.layout.numels),
                 "shapes": [list(p.shape) for p in self.params], "partition_bytes": opts.partition_bytes,
                 "digest": self.layout.digest(), "strategy": opts.strategy, "lr": opts.lr,
                 "momentum": opts.momentum, "weight_decay": opts.weight_decay}
        if opts.optimizer != OPTIMIZER_DEFAULTS["optimizer"]:  # (SGD's HELLO is the one it was before Adam)
            hello.update(optimizer=opts.optimizer, betas=list(opts.betas), eps=opts.eps)
        links = []
        k, endpoint = 0, servers[0]
        join = opts.join_s  # (joining: a server still starting, or setting up its shard at the first HELLO)
        try:
            for k, endpoint in enumerate(servers):
                try:
                    sock = P.dial(endpoint, me, k, join, name=f"parameter server {k}")  # (the endpoint: below)
                except CommError as exc:  # (wire's checks number peers as the handshake does: say which is which)
                    sizes = (f"; world size {K + W} = {K} server(s) + workers={W}: a server that says another was "
                             "started for another number of workers or servers" if "world size" in str(exc) else "")
                    raise type(exc)(f"worker {self.worker} could not join parameter server {k} at {endpoint[0]}:"
                                    f"{endpoint[1]}: {exc} (handshake ranks: servers 0..{K - 1}, worker w is "
                                    f"{K} + w{sizes})") from None
                ch = P.Channel(sock, f"parameter server {k} at {endpoint[0]}:{endpoint[1]}", opts.timeout)
                links.append(_Link(k, ch))
                ch.send(P.HELLO, worker=self.worker, body=P.encode_json(hello))
            for link in links:
                k, endpoint = link.k, servers[link.k]
                head = link.ch.recv_header(join)
                if head.kind != P.WELCOME:
                    raise ProtocolError(f"{link.ch.peer} answered HELLO with {head.name}")
                welcome = link.ch.recv_json(head)
                link.version = int(welcome["version"])
                link.clock = int(welcome["clock"])
                link.max_staleness = _staleness_of(welcome, link.ch.peer)
                # A server that does not say its optimizer predates Adam: it would ignore the HELLO's
                # "optimizer" and apply SGD (and one that says another could only be a bug).
                applies = welcome.get("optimizer", "sgd")
                if applies != opts.optimizer:
                    raise MismatchError(f"worker {self.worker}: {link.ch.peer} applies optimizer {applies!r}, this "
                                        f"worker's is {opts.optimizer!r}"
                                        + (" (the server's ringtrain predates Adam on the servers: update it)"
                                           if "optimizer" not in welcome else ""))
                if welcome.get("needs_init"):
                    self._send_values(link, P.INIT)
        except EOFError:
            self._close_links(links)
            raise PeerLost(f"worker {self.worker}: parameter server {k} at {endpoint[0]}:{endpoint[1]} closed the "
                           "connection before it answered HELLO (it stopped or refused this worker)") from None
        except BaseException:
            self._close_links(links)
            raise
        return links

    @staticmethod
    def _close_links(links: list[_Link]) -> None:
        for link in links:
            link.ch.close()

    def _agreed_clock(self) -> int:
        clocks = {link.clock for link in self._links}
        if len(clocks) != 1:
            # A server agrees with the shard folders it can see; on several machines without a shared
            # disk, a save cut short on one machine leaves the others' servers a step ahead.
            oldest = min(clocks)
            ahead = ", ".join(f"{link.ch.peer} resumed at step {link.clock}" for link in self._links if link.clock > oldest)
            raise ProtocolError(f"the servers disagree about this worker's step: {sorted(clocks)} (their checkpoints "
                                f"are of different steps: {ahead}). A server resumes at the newest step saved in "
                                f"every server-<k> folder it can see: remove the checkpoints after step {oldest} from "
                                "the servers ahead, or keep checkpoint_dir on a file system every machine shares")
        return clocks.pop()

    def _send_values(self, link: _Link, kind: int) -> None:
        views = [numpy_of(self._flat(self.params[p.param])[p.start: p.stop]) for p in self._shards[link.k]]
        link.ch.send(kind, worker=self.worker, ids=self._ids[link.k], values=views)

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.detach().view(-1)

    def _install_hooks(self) -> None:
        index = {id(p): i for i, p in enumerate(self.params)}
        me = weakref.ref(self)  # (the module's hooks hold the worker weakly: _call)
        for i, p in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: _call(me, "_grad_ready", i)))
        self._owners: list[set[int]] = [set() for _ in self.params]  # ids of the modules holding each
        self._handles.append(self.module.register_forward_pre_hook(lambda _m, _args: _call(me, "_wait_outside")))
        for m in self.module.modules():
            own = sorted({index[id(p)] for p in m.parameters(recurse=False) if id(p) in index})
            for i in own:
                self._owners[i].add(id(m))
            if own:
                self._handles.append(m.register_forward_pre_hook(partial(_call, me, "_module_called", own)))

    def _module_called(self, own: list[int], module: nn.Module, _args: Any) -> None:
        """A module's forward pre-hook: wait for its own parameters (returns None: the inputs stay)."""
        self._called.add(id(module))
        self._wait_params(own)

    def _wait_outside(self) -> None:
        """The root's forward pre-hook: every parameter until the first step() has found the
        read-outside ones (module docstring), then those."""
        self._wait_params(self._outside if self._found_outside else range(len(self.params)))

    def _find_outside(self) -> None:
        """At step(): parameters with a gradient none of whose modules this step's forwards called.
        A step that called no module at all (a worker without data taking part with a zero loss
        over the parameters) says nothing about where forward reads them."""
        if not self._called:
            return
        found = [i for i, ready in enumerate(self._ready) if ready and not self._owners[i] & self._called]
        self._called.clear()
        new = sorted(set(found) - set(self._outside))
        if new and self._found_outside:
            shown = ", ".join(self._names[i] for i in new[:6]) + (f" and {len(new) - 6} more" if len(new) > 6 else "")
            log.warning("worker %d: %s got a gradient in step %d without a forward of a module holding them (read by "
                        "another module, or held in a ParameterList): forward waits for them from now on, but this "
                        "step may have read them before their pulled values were in (overlap_pull=False waits for "
                        "every parameter)", self.worker, shown, self.step_count)
        self._outside = sorted(set(self._outside) | set(new))
        self._found_outside = True

    # --- the loop ---------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._raise_if_closed()
        if self._step_lr is None:  # (refused before backward, not in its first push's hook)
            lr = self.optimizer.learning_rate()
            if torch.is_grad_enabled():  # the step's forward: its rate (an evaluation's is not)
                self._step_lr = lr
        return self.module(*args, **kwargs)

    @property
    def lr(self) -> float:
        """The learning rate of the next step (``optimizer.param_groups[0]["lr"]``); set it between
        steps, before the next forward."""
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        group = self.optimizer.param_groups[0]
        before, group["lr"] = group["lr"], value
        try:
            self.optimizer.learning_rate()
        except ValueError:
            group["lr"] = before
            raise

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError(f"worker {self.worker}: this ParameterServerTraining was closed (its servers said "
                               "BYE); make a new one to train on")

    def _grad_ready(self, i: int) -> None:
        if not self._calibrated:
            self._stamps.setdefault(i, time.perf_counter())
        if self._ready[i]:
            self._double_backward = True
            return
        self._ready[i] = True
        g = self._group_of[i]
        self._left[g] -= 1
        if self._left[g] == 0:
            self._push_group(g)

    def _push_group(self, g: int) -> None:
        if self.opts.strategy != "async" and self._pulled <= self.step_count:  # this step's first push
            # Synchronous servers take pushes of their own step only: with every parameter of this
            # step in, every server has finished it. Forward waited for the parameters it used;
            # a module that did not run may still be waiting for another worker's step() (it
            # pushes gradients nobody computed as zeros), so this rarely waits at all.
            self._wait_params(range(len(self.params)))
            self._issue_pulls(self.step_count + 1)  # streamed: servers send partitions as they step them
        if self._step_lr is None:  # (no forward through this wrapper took it)
            self._step_lr = self.optimizer.learning_rate()
        self._pushed[g] = True
        members = set(self._groups[g])
        # The group's partitions by server, in shard order (by id): from its parameters' own
        # partitions, not a walk of every shard (one per group made a step quadratic in the
        # number of parameters: 3,000 of them, each its own group, 4.5M tests a step).
        by_server: list[list[Partition]] = [[] for _ in range(self.num_servers)]
        for i in members:
            for p in self._pieces[i]:
                by_server[p.server].append(p)
        for link in self._links:
            parts = sorted(by_server[link.k], key=_by_id)
            if not parts:
                continue
            views = []
            for p in parts:
                grad = self.params[p.param].grad
                flat = torch.zeros(self.params[p.param].numel()) if grad is None else grad.detach().reshape(-1)
                views.append(numpy_of(flat[p.start: p.stop]))
            ids = np.array([p.id for p in parts], dtype=np.int64)
            # The version of the parameters these gradients come from: synchronous servers are at
            # this step (link.version may already be the next, streamed in during backward).
            version = link.version if self.opts.strategy == "async" else self.step_count
            link.jobs.put(("push", self.step_count, version, ids, views, self._step_lr))
        for i in members:
            grad = self.params[i].grad
            if grad is not None:
                self._pushed_grads.append((i, grad, grad._version))

    def step(self) -> None:
        """Push the gradients not pushed yet, clear them, and ask every server for the next parameters:
        ``optimizer.step()``, which torch's schedulers (and optimizer hooks) see as the optimizer's step."""
        self.optimizer.step()

    def _step(self) -> None:
        self._raise_if_closed()
        self._raise_if_failed()
        if self._double_backward:
            # Refused once: the step can still be finished, as said below (the gradients the second
            # backward changed after their push are part of what this says).
            self._double_backward, self._pushed_grads = False, []
            raise RuntimeError(
                f"worker {self.worker}: backward ran twice before step(): gradient accumulation is not supported "
                "with parameter servers; call ps.step() after every backward. This step's gradients went to the "
                "servers during the first backward (where a push had not left yet, with the second backward's "
                f"added): step() again finishes the step with them{RETRY_NOTE}")
        self._check_pushed_grads()
        self._check_params_unwritten()
        self._check_unserved()
        self._check_some_gradient()
        if self.opts.overlap_pull:  # (after the refusals: a step() tried again finds the same)
            self._find_outside()
        left = [g for g, pushed in enumerate(self._pushed) if not pushed]
        if left:  # parameters without a gradient: pushed as zeros, once their values of this step are in
            self._wait_params([i for g in left for i in self._groups[g]])
        for g in left:
            self._push_group(g)
        if not self._calibrated:
            self._plan()
        for p in self.params:
            p.grad = None  # the sender threads keep the tensors they still have to send
        self._pushed_grads = []
        self._warn_if_lr_changed()
        self.step_count += 1
        if self._pulled < self.step_count:
            self._issue_pulls(self.step_count)
        self._reset_groups()
        if not self.opts.overlap_pull:
            self.wait()

    def _warn_if_lr_changed(self) -> None:
        """A learning rate set after the step's forward took it (a scheduler stepped between
        backward and step()) is the next step's: say so, as torch's schedulers warn of that order."""
        now, took = self.optimizer.param_groups[0]["lr"], self._step_lr
        self._step_lr = None
        if now != took:
            warnings.warn(f"worker {self.worker}: the learning rate changed to {now} after step {self.step_count}'s "
                          f"forward, whose gradients go to the servers with {took}: it applies from the next step. "
                          "Set it before the forward (a scheduler's step() after the optimizer's, torch's order)",
                          stacklevel=_caller_level())

    def _check_pushed_grads(self) -> None:
        """A gradient changed in place after its push began (e.g. clip_grad_norm_ between backward
        and step) would reach the servers half changed: refuse it."""
        cleared = [self._names[i] for i, _, _ in self._pushed_grads if self.params[i].grad is None]
        if cleared:
            self._pushed_grads = []
            raise RuntimeError(
                f"worker {self.worker}: the gradients of {cleared[:6]}{' and more' if len(cleared) > 6 else ''} were "
                "cleared (zero_grad) after backward had pushed them to the servers, which hold them "
                "now: with parameter servers a step cannot be skipped once its backward ran (e.g. on a non-finite "
                "loss: test the loss before calling backward). step() again finishes the step with what was "
                f"pushed{RETRY_NOTE}")
        changed = [self._names[i] for i, g, v in self._pushed_grads
                   if self.params[i].grad is not g or g._version != v]  # (replaced, or changed in place)
        if changed:
            self._pushed_grads = []
            raise RuntimeError(
                f"worker {self.worker}: the gradients of {changed} changed after backward had pushed them to the "
                "servers, which may have received them half changed. With parameter servers, gradients go out "
                "during backward: change them in a hook before they are accumulated (Tensor.register_hook), "
                f"not between backward() and step(). step() again finishes the step with what was pushed{RETRY_NOTE}")

    def _check_params_unwritten(self) -> None:
        """A parameter written in place on this worker (a local optimizer's step) is overwritten by
        the servers' values, or mixed with them when the pull is being written into it: refuse it."""
        changed = [self._names[i] for i, (p, v) in enumerate(zip(self.params, self._versions)) if p._version != v]
        if changed:
            self._versions = [p._version for p in self.params]
            shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
            raise RuntimeError(
                f"worker {self.worker}: parameters {shown} were changed in place on this worker (a local "
                "optimizer's step(), load_state_dict, or another in-place write) since the last ps.step() or the "
                "start. The parameter servers own the parameters and the optimizer (ParameterServerTraining's lr, "
                "momentum, weight_decay) and their pulled values are written into the same memory, so such a change "
                "is lost or mixed with them: do not step a local optimizer; ps.step() is the optimizer step. This "
                "step's gradients (from the changed values) went out during backward: step() again finishes the step "
                f"with them, and the servers' values replace the changed ones{RETRY_NOTE}")

    def _check_unserved(self) -> None:
        """A parameter that did not require a gradient when this was made is not on the servers; one
        unfrozen since gets gradients that nobody applies (they pile up in its .grad): refuse it."""
        got = [name for name, p in self._unserved if p.grad is not None]
        if got:
            raise RuntimeError(
                f"worker {self.worker}: {', '.join(got)} got a gradient, but it did not require one when this "
                "ParameterServerTraining was made, so the servers do not hold it and its gradient would never be "
                "applied: set requires_grad before wrapping the module (make a new ParameterServerTraining, "
                "with new servers, to train it)")

    def _check_some_gradient(self) -> None:
        """step() with no gradient at all (no backward since the last step(), or ever) would push
        zeros, and the servers' momentum and weight decay would still move every parameter, where
        torch's optimizers skip parameters whose .grad is None: refuse it before anything is pushed.
        (Some parameters without a gradient beside others that have one are pushed as zeros.)"""
        if any(self._pushed) or any(p.grad is not None for p in self.params):
            return
        raise RuntimeError(
            f"worker {self.worker}: step() was called but no parameter has a gradient (no backward() since the last "
            "ps.step(), which clears them, or since zero_grad(set_to_none=True), or none yet), and nothing was "
            "pushed: the servers would apply zero gradients, whose momentum and weight decay still move the "
            "parameters. Nothing was sent; call loss.backward() before ps.step() (a worker with no data for a "
            "synchronous step can take part with a zero loss, e.g. "
            "sum(p.sum() for p in model.parameters()) * 0)")

    def _plan(self) -> None:
        """Group parameters for pushes from the first step's backward timings."""
        self._calibrated = True
        order = sorted(self._stamps, key=self._stamps.get) + [i for i in range(len(self.params)) if i not in self._stamps]
        t = [self._stamps.get(i, 0.0) for i in order]
        gaps = [0.0] + [max(0.0, b - a) for a, b in zip(t, t[1:])]
        sizes = [4.0 * self.params[i].numel() for i in order]
        plan = planner.merge(gaps, sizes, self.opts.alpha, self.opts.beta, method=self.opts.schedule,
                             bucket_cap_mb=self.opts.bucket_cap_mb)
        self._groups = [order[a: b + 1] for a, b in plan.groups]

    def _reset_groups(self) -> None:
        self._group_of = {i: g for g, members in enumerate(self._groups) for i in members}
        self._left = [len(m) for m in self._groups]
        self._pushed = [False] * len(self._groups)
        self._ready = [False] * len(self.params)
        self._double_backward = False

    def _issue_pulls(self, step: int) -> None:
        self._pulled = step
        for link in self._links:
            link.jobs.put(("pull", step))

    def _param_in(self, i: int) -> bool:
        return all(self._arrived[j] >= self.step_count for j in self._parts_of[i])

    def _deadline(self, t0: float, span: float) -> float:
        """When a wait on the servers begun at ``t0`` ends: ``span`` later, or, while it may be on a
        worker still connecting (module docstring), no earlier than ``join_timeout`` + 2 × ``timeout``
        after this worker connected: the servers lose such a worker ``join_timeout`` after the first
        connected (this one was no earlier), and a wait they hold for a silent one ends ``timeout``
        after that."""
        joining = self.step_count <= self._joined_after
        return max(t0 + span, self._joining_until) if joining else t0 + span

    def _wait_params(self, indices: Sequence[int]) -> None:
        # Twice ``timeout``: a server holding this worker's pull for a silent worker drops that one
        # only after ``timeout`` of its own, and answers then (asynchronous: the parameters;
        # synchronous: the error naming the worker lost); a wait of ``timeout`` ended at that moment.
        t0 = time.monotonic()
        try:
            self._wait_params_until(indices, t0, self._deadline(t0, 2 * self.opts.timeout))
        finally:
            self.pull_wait_s += time.monotonic() - t0

    def _wait_params_until(self, indices: Sequence[int], t0: float, deadline: float) -> None:
        with self._cond:
            # Checked front to back, each once it is in: a wake-up per arriving partition rechecked
            # every parameter (thousands of small ones made a step quadratic in their number).
            missing = deque(i for i in indices if not self._param_in(i))
            while missing:
                if self._param_in(missing[0]):
                    missing.popleft()
                    continue
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    slow = sorted({self._part[j].server for i in missing if not self._param_in(i)
                                   for j in self._parts_of[i] if self._arrived[j] < self.step_count})
                    why = ("" if self.opts.strategy == "async" else
                           " (a synchronous server sends them once every worker's gradients of the step are in, "
                           "and names a worker that holds them up for its timeout)")
                    raise CommTimeout(f"worker {self.worker}: parameters from parameter server(s) {slow} "
                                      f"did not arrive within {round(deadline - t0, 1):g} s{why}")
                self._cond.wait(min(left, 0.5))

    def wait(self) -> None:
        """Block until the parameters of this step are all in (after step(), e.g. before evaluating)."""
        self._raise_if_closed()
        self._wait_params(range(len(self.params)))

    def save_checkpoint(self, *, background: bool = False) -> None:
        """Have every server checkpoint its shard at this worker's step (call from one worker).

        A server that cannot save (no checkpoint directory, a write error) says why: raised as a
        CommError naming it; the connections stay up and training may go on.

        ``background``: return once every server has copied its shard, which it writes on a thread
        of its own, so that no worker waits for the servers' disks (a write longer than ``timeout``
        failed the job). A write that fails is raised by the next save_checkpoint; the last one's
        error fails its server at the end of the job (ps.run_server)."""
        self._raise_if_closed()
        step = self.step_count
        with self._cond:  # (a save of the same step again waits for its own answers)
            for link in self._links:
                link.saved, link.save_error = -1, None
        for link in self._links:
            link.jobs.put(("save", step, int(background)))
        deadline = self._deadline(time.monotonic(), self.opts.timeout)
        with self._cond:
            while any(link.saved < step for link in self._links):
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise CommTimeout(f"worker {self.worker}: servers did not save step {step} in time")
                self._cond.wait(0.5)
            failed = [f"{link.ch.peer}: {link.save_error}" for link in self._links if link.save_error]
        if failed:
            raise CommError(f"worker {self.worker}: the checkpoint of step {step} was not saved: " + "; ".join(failed))

    def close(self) -> dict:
        """Say BYE to every server, wait for their answers, release everything; return stats()."""
        if self._closed:
            return self.stats()
        self._closed = True
        try:
            if self._error is None:
                for link in self._links:
                    link.jobs.put(("bye",))
                deadline = self._deadline(time.monotonic(), self.opts.timeout)
                with self._cond:
                    while any(link.bye is None for link in self._links) and self._error is None:
                        if time.monotonic() > deadline:
                            raise CommTimeout(f"worker {self.worker}: servers did not answer BYE in time")
                        self._cond.wait(0.5)
            self._raise_if_failed()
        finally:
            self._release()
        return self.stats()

    def _release(self) -> None:
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()  # (the list the finalizer holds)
        self._at_exit.detach()
        _stop_links(self._links)

    def __enter__(self) -> "ParameterServerTraining":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except CommError:
                pass

    # --- threads --------------------------------------------------------------------------------
    def _send(self, link: _Link, job: tuple) -> bool:
        """Send one of ``link``'s jobs (``_link_loop``); False once the link failed (told)."""
        try:
            kind = job[0]
            if kind == "push":
                _, step, version, ids, views, lr = job
                link.ch.send(P.PUSH, worker=self.worker, step=step, version=version, lr=lr, ids=ids, values=views)
            elif kind == "pull":
                link.ch.send(P.PULL, worker=self.worker, step=job[1])
            elif kind == "save":
                link.ch.send(P.SAVE, worker=self.worker, step=job[1], extra=job[2])
            elif kind == "bye":
                link.ch.send(P.BYE, worker=self.worker)
            return True
        except (CommError, OSError) as exc:
            error = exc if isinstance(exc, CommError) else PeerLost(f"{link.ch.peer} is gone ({exc})")
            if isinstance(error, PeerLost):  # (the receiver reads the server's last word, if it said one)
                link.received_all.wait(min(REASON_GRACE_S, self.opts.timeout))
            self._fail(error, link)
            return False

    def _receive(self, link: _Link, head: Any) -> bool:
        """Take one message from ``link``'s server (``head``: its header, or the exception that
        reading it raised; ``_link_loop``); False once the receiver is done."""
        shard = self._shards[link.k]
        try:
            if isinstance(head, EOFError):
                if link.bye is not None or self._closed:
                    return False
                raise PeerLost(f"{link.ch.peer} closed the connection (the server died or was stopped)") from None
            if isinstance(head, BaseException):
                raise head
            if head.kind == P.PARAMS:
                ids = link.ch.recv_ids(head, len(shard)).tolist()
                parts = [self._part.get(j) for j in ids]
                if (len(set(ids)) != len(ids) or any(p is None or p.server != link.k for p in parts)
                        or head.body != 4 * len(ids) + 4 * sum(p.numel for p in parts)):
                    raise ProtocolError(f"{link.ch.peer} sent PARAMS that do not match its shard")
                for p in parts:
                    link.ch.recv_into(numpy_of(self._flat(self.params[p.param])[p.start: p.stop]))
                    with self._cond:
                        self._arrived[p.id] = head.step
                        self._cond.notify_all()
                link.version = head.version
                self._note_live(head.extra, link)
            elif head.kind == P.SAVED:
                why = None
                if head.extra or head.body:  # a save that failed, and why
                    why = str(link.ch.recv_json(head).get("error"))[:2000]
                with self._cond:
                    link.save_error = why
                    link.saved = head.step
                    self._cond.notify_all()
            elif head.kind == P.BYE:
                stats = link.ch.recv_json(head)
                with self._cond:
                    link.bye = stats
                    self._cond.notify_all()
                return False
            else:
                raise ProtocolError(f"{link.ch.peer} sent {head.name}, which servers do not send")
            return True
        except CommError as exc:
            self._fail(exc, link)
        except OSError as exc:
            self._fail(PeerLost(f"{link.ch.peer} is gone ({exc})"), link)
        return False

    def _note_live(self, live: int, link: _Link) -> None:
        if live < self._live:
            note = (f"worker {self.worker}: {link.ch.peer} reports {live} of {self.workers} workers left; "
                    "asynchronous training goes on with them")
            self._live = live
            self.notices.append(note)
            # Once, on the ringtrain.ps logger (printed to stderr where logging is not set up): a
            # warnings.warn beside it printed the notice twice, the second time pointing at this
            # receiver thread's line instead of anything of the user's.
            log.warning("%s", note)

    def _fail(self, exc: CommError, link: _Link) -> None:
        with self._cond:
            if self._error is None and not (self._closed and link.bye is not None):
                self._error = exc
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # --- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Bytes each way per server, steps, groups, the staleness bound and what the servers reported at BYE."""
        per_server = {str(l.k): {"sent": l.ch.bytes_sent, "received": l.ch.bytes_received} for l in self._links}
        hist: Counter[int] = Counter()
        for link in self._links:
            for s, n in ((link.bye or {}).get("staleness_histogram") or {}).items():
                hist[int(s)] += n
        return {
            "worker": self.worker,
            "strategy": self.opts.strategy,
            "servers": self.num_servers,
            "steps": self.step_count,
            "push_groups": len(self._groups),
            "pull_wait_s": self.pull_wait_s,
            "bytes_sent": sum(v["sent"] for v in per_server.values()),
            "bytes_received": sum(v["received"] for v in per_server.values()),
            "bytes_per_server": per_server,
            "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
            # (every server of a job has the one bound of its WELCOME; None: unbounded)
            "max_staleness": self._links[0].max_staleness if self._links else 0,
            "server_stats": [link.bye for link in self._links],
            "notices": list(self.notices),
        }


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel, from its caller's frame, of the first frame outside ringtrain
    and torch: the user's line, whether it called ``step()`` or ``optimizer.step()`` (which torch
    wraps once or twice)."""
    import sys

    inside = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent))
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        level, frame = level + 1, frame.f_back
    return level


def _endpoints(servers: Any) -> list[tuple[str, int]]:
    """``servers`` as a list of (host, port) pairs, or a ValueError that shows what was given."""
    usage = "servers must be a list of (host, port) endpoints, one per server, e.g. [('10.0.0.5', 29600)]"
    if isinstance(servers, (str, bytes)) or not isinstance(servers, Sequence) or len(servers) < 1:
        raise ValueError(f"{usage}; got {servers!r}")
    out = []
    for k, ep in enumerate(servers):
        if (isinstance(ep, (str, bytes)) or not isinstance(ep, Sequence) or len(ep) != 2
                or not isinstance(ep[0], str) or isinstance(ep[1], bool) or not isinstance(ep[1], int)
                or not 0 < ep[1] < 65536):
            raise ValueError(f"{usage}; entry {k} is {ep!r}")
        out.append((ep[0], int(ep[1])))
    return out


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    out, seen = [], set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dtype != torch.float32 or not p.is_contiguous() or p.device.type != "cpu":
            # (a module has no .contiguous(): a channels_last one is converted back by its memory_format)
            raise ValueError(f"parameter servers serve contiguous float32 CPU parameters; {name!r} is {p.dtype} "
                             f"on {p.device} (contiguous={p.is_contiguous()}): convert the module before wrapping "
                             "it (module.float(); a channels_last one: "
                             "module.to(memory_format=torch.contiguous_format))")
        out.append(p)
    return out
