"""In-place recovery for PyTorch DDP scripts under muster's ``launch --in_place``
(docs/in_place_torch.md).

A failure anywhere in the job (a worker crashed, a node lost, a node added within
``--nnodes=MIN:MAX``) changes the world. Without this module every worker is restarted: the
interpreter, ``import torch``, the process group and the checkpoint read, again. With it the
survivors keep their processes: this module leaves the broken process group, joins the new
one with the new rank and world size through the agent's store, brings a replacement or a
newcomer the survivors' model, optimizer, scheduler and scaler state over the new group, and
the training loop goes on from the last step every rank can agree on::

    import muster_inplace

    job = muster_inplace.Job(model, optimizer, scheduler=sched, start_step=ckpt_step)
    for step in job.steps(total_steps):
        with job.step():
            x, y = batch(step, job.rank, job.world_size)
            optimizer.zero_grad()
            loss = loss_fn(job.model(x), y)   # job.model: the DDP wrapper of this world
            loss.backward()
            optimizer.step()
            sched.step()

``Job`` creates the process group itself (do not call ``init_process_group``). Without
``launch --in_place`` (under torchrun, or launch without the flag) it does what a DDP script
does anyway, ``init_process_group(env://)`` and ``DistributedDataParallel``, and a failure
raises as before: the launcher's full restart. A single file with no dependency beyond torch:
``launch`` puts its folder on PYTHONPATH for Python workers.

How (docs/in_place.md, "Control channel"): the agent that started this process names one end
of a SOCK_SEQPACKET socket pair in MUSTER_CONTROL_FD. This module says ``hello in_place=1``
on it, and a thread blocked in recv() takes the agent's ``abort`` and ``world`` messages. An
``abort`` makes the next step boundary (or the step's failed collective) leave the process
group; destroying it closes this rank's sockets, so a peer blocked on this rank fails at once
rather than after gloo's timeout. The ``world`` message gives the new rank, world size, round
and store; the new group's keys live under ``muster_inplace/r<round>/`` in the agent's store
(the TCPStore-protocol store that TORCHELASTIC_USE_AGENT_STORE names: no worker hosts it, so
a rank 0 that dies takes nothing with it). After the first step completed in the new world
the module answers ``resumed round=R``; an agent that does not hear it from every worker
within its in-place timeout falls back to the full restart.

Warm spares (``launch --in_place --spares=N``; docs/in_place_torch.md, "Warm spares"): a
script that calls ``muster_inplace.await_rank()`` after its heavy imports and before it reads
its rank can be started ahead of need. Such a process waits there, ready, until a worker of
its node dies; it then takes the dead worker's rank at once (its environment becomes that
rank's) and goes on as a new process of that rank would, without the survivors waiting for an
interpreter to start and torch to be imported::

    import torch                      # what takes long: before
    import muster_inplace
    muster_inplace.await_rank()       # a spare waits here; anyone else goes straight on
    rank = int(os.environ["RANK"])    # from here on, as any worker
"""

import datetime
import os
import socket
import sys
import threading
import time

__all__ = ["Job", "RecoveryError", "await_rank"]

_FD_VAR = "MUSTER_CONTROL_FD"
_SPARE_VAR = "MUSTER_SPARE"  # "1" in a warm spare (ops/worker_env_names.h)
_MAX_MESSAGE = 1024  # ops/control_channel.h kMaxMessageBytes
_PREFIX = "muster_inplace"
# How long a failed step waits for the agent's abort or world before it is taken for a bug of
# the script (the exception is raised as it was): the agent hears of a lost peer within one
# round trip of the server's decision, far less than this.
DEFAULT_FAILURE_WAIT = datetime.timedelta(seconds=20)
# How long the collectives of a step (or of a re-form) may stay blocked after the agent's abort
# before the process is taken for stuck and exits, so that its agent starts the rank anew
# (_StuckWatch). gloo (torch 1.13's and later) never fails a send it queued on a connection
# its peer had just reset: a collective can stay blocked for the whole process-group timeout
# (torch's default: 30 minutes) after the group's sockets were shut. The wait is this, or three
# times the longest of the last steps when that is longer (a long step's compute is not a
# stuck collective).
DEFAULT_STUCK_WAIT = datetime.timedelta(seconds=3)
STUCK_STEP_FACTOR = 3
STUCK_EXIT_CODE = 75  # the process's exit status when it gives up a stuck collective
# How long a rank waits for the next world after an abort. The agent bounds the whole
# recovery anyway (rdzv_conf in_place_timeout) and falls back to the full restart.
DEFAULT_WORLD_WAIT = datetime.timedelta(minutes=5)


class RecoveryError(RuntimeError):
    """The world could not be re-formed in place: the process exits and the agent restarts it."""


def _parse(data):
    """One control message: (kind, {key: value}), or None for what the contract refuses."""
    if not data or len(data) > _MAX_MESSAGE:
        return None
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not text.isprintable():
        return None
    kind, *parts = text.split(" ")
    fields = {}
    for p in parts:
        key, sep, value = p.partition("=")
        if not sep or not key or not value:
            return None
        fields[key] = value
    return (kind, fields) if kind else None


# What the first DistributedDataParallel of a process imports, where torch has it: torch 2.x
# imports torch._dynamo (and with it _inductor and sympy, ~800 modules) there, 1.2-1.5 s on
# this project's 2-core machine, which survivors would wait for in a new process's first
# re-form. A spare imports it on a thread while it waits for a rank, any other new process in
# place while it joins (_prefetch).
_FIRST_DDP_IMPORTS = ("torch._dynamo",)


def _import_first_ddp():
    import importlib
    for name in _FIRST_DDP_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # not in this torch (1.x), or broken: DDP will say so itself
            pass


_prefetching = None  # the thread of the last _prefetch()


def _prefetch():
    """_import_first_ddp on a daemon thread: a DDP built meanwhile waits on the import's lock."""
    global _prefetching
    _prefetching = threading.Thread(target=_import_first_ddp, name="muster-prefetch", daemon=True)
    _prefetching.start()


def await_rank():
    """Under ``launch --in_place``: tells the agent that this program can be started as a warm
    spare. In a spare (MUSTER_SPARE=1), waits until the agent hands it a dead worker's rank,
    sets the variables of that rank's environment in ``os.environ`` and returns True; the
    process then runs as a new process of that rank would. Anywhere else it returns False at
    once. A spare whose agent goes away exits quietly (it had no rank to fail)."""
    fd = os.environ.get(_FD_VAR, "")
    if not fd.isdigit():
        return False
    if os.environ.get(_SPARE_VAR, "") == "1":
        # Warm while it waits: its take is then the re-form alone. On a thread, so that the
        # hello is not held back by it (a spare runs at nice 19: on a busy machine the import
        # could take longer than the agent waits for a spare to be ready).
        _prefetch()
    sock = socket.socket(fileno=os.dup(int(fd)))  # Job's channel takes the descriptor later
    try:
        try:
            sock.send(b"hello spare=1")
        except OSError:
            return False
        if os.environ.get(_SPARE_VAR, "") != "1":
            return False
        while True:
            try:
                data = sock.recv(_MAX_MESSAGE + 1)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                os._exit(0)
            msg = _parse(data)
            if msg is not None and msg[0] == "take":
                break
        for name, value in msg[1].items():
            os.environ[name] = value
        del os.environ[_SPARE_VAR]
        return True
    finally:
        sock.close()


class _Channel:
    """The worker's end of the control channel: a reader thread blocked in recv()."""

    def __init__(self, fd, on_abort=None):
        # called on the reader thread when an abort or world comes, with the epoch it made
        self._on_abort = on_abort
        self._sock = socket.socket(fileno=fd)
        self._cv = threading.Condition()
        self._epoch = 0  # counts abort and world messages
        self._world = None
        self._world_epoch = 0  # the epoch once _world had come
        self._closed = False
        self._sock.send(b"hello in_place=1")
        # What the agent said before this process listened (an abort and a newer world for a
        # replacement that was still starting) is taken now, before the first group is joined.
        self._sock.setblocking(False)
        try:
            while True:
                data = self._sock.recv(_MAX_MESSAGE + 1)
                if not self._take(data):
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._take(b"")
        self._sock.setblocking(True)
        threading.Thread(target=self._read, name="muster-control", daemon=True).start()

    def _read(self):
        while not self._closed:
            try:
                data = self._sock.recv(_MAX_MESSAGE + 1)
            except OSError:
                data = b""
            self._take(data)

    def _take(self, data):
        """One packet (b"": the channel closed); False once closed."""
        aborted = None
        with self._cv:
            if not data:
                self._closed = True
                self._cv.notify_all()
                return False
            msg = _parse(data)
            if msg is None:
                return True
            kind, fields = msg
            if kind == "abort":
                self._epoch += 1
            elif kind == "world":  # a new world aborts the one before too, as the runtime's does
                self._world = fields
                self._epoch += 1
                self._world_epoch = self._epoch
            else:
                return True
            aborted = self._epoch
            self._cv.notify_all()
        if aborted is not None and self._on_abort is not None:
            self._on_abort(aborted)
        return True

    def epoch(self):
        with self._cv:
            return self._epoch

    def wait_change(self, seen, timeout):
        """True once an abort or world arrived after epoch `seen`, within `timeout` seconds."""
        with self._cv:
            return self._cv.wait_for(lambda: self._epoch != seen or self._closed, timeout) and \
                self._epoch != seen

    def await_world(self, after_round, timeout):
        """The first world for a round after `after_round`, and the epoch it came with: an abort
        after it (the world after it on its way) is newer than it, so a join of it fails at
        once rather than wait for peers that are gone."""
        def ready():
            return self._closed or (self._world is not None and
                                    int(self._world.get("round", "0")) > after_round)
        with self._cv:
            if not self._cv.wait_for(ready, timeout):
                raise RecoveryError("no new world from the agent within %g s" % timeout)
            if self._world is None or int(self._world.get("round", "0")) <= after_round:
                raise RecoveryError("the agent closed the control channel")
            return dict(self._world), self._world_epoch

    def resumed(self, round_):
        try:
            self._sock.send(("resumed round=%d" % round_).encode())
        except OSError:
            pass  # the agent is gone: it stops this process anyway


class _StuckWatch:
    """Whether the main thread leaves a blocking region (a step's body, a re-form's
    collectives on the group it formed) after the agent's abort. A region belongs to a world
    (the control channel's epoch when the world was adopted); a later message while it is open
    arms a timer, and if the same region is still open when the timer fires, `on_stuck` is
    called (on the timer's thread) with the seconds waited. A join is no such region: it waits
    for peers that may still be starting, and an abort ends it by shutting its sockets. The
    wait: `minimum`, or STUCK_STEP_FACTOR times the longest of the last steps' durations when
    that is longer."""

    _KEPT = 16  # the steps whose durations set the wait

    def __init__(self, minimum, on_stuck, clock=time.monotonic):
        self._minimum = minimum
        self._on_stuck = on_stuck
        self._clock = clock
        self._lock = threading.Lock()
        self._region = 0  # counts entries: a region's identity
        self._open = False
        self._epoch = 0  # the open region's world
        self._entered = 0.0
        self._steps = []  # the last steps' durations (seconds)

    def enter(self, epoch):
        with self._lock:
            self._region += 1
            self._open = True
            self._epoch = epoch
            self._entered = self._clock()

    def leave(self, step_done=False):
        """The region ended; `step_done`: it was a step that completed (its time counts)."""
        with self._lock:
            self._open = False
            if step_done:
                self._steps.append(self._clock() - self._entered)
                del self._steps[:-self._KEPT]

    def wait(self):
        with self._lock:
            longest = max(self._steps, default=0.0)
        return max(self._minimum, STUCK_STEP_FACTOR * longest)

    def aborted(self, epoch):
        """On the reader thread, at an abort or world that moved the channel to `epoch`: arms
        the timer if a region of an earlier world is open. The timer."""
        with self._lock:
            if not self._open or self._epoch >= epoch:
                return None
            region = self._region
        wait = self.wait()
        timer = threading.Timer(wait, self._check, args=(region, wait))
        timer.daemon = True
        timer.start()
        return timer

    def _check(self, region, wait):
        with self._lock:
            stuck = self._open and self._region == region
        if stuck:
            self._on_stuck(wait)


def _socket_fds():
    """{fd: socket inode} of this process's open sockets."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = target[8:-1]
    return out


def _shut_connection(fd):
    """Shuts down the connected socket `fd` (both ways), so that a recv or send blocked on it
    returns at once. Never a listening socket: gloo's listener thread (torch 2.x) takes a failed
    accept() for a bug and aborts the whole process (``listener.cc: accept: Invalid argument``);
    the group's connections are what a blocked collective waits on."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _tcpstore(dist, addr, port, timeout):
    """A client of the agent's store. USE_LIBUV=0 asks for torch's own socket code, as torch's
    env:// does: a torch built without libuv (Debian's 2.x) refuses a store that asks for it,
    and torch 2.x asks by default. Torch 1.x has no such choice (no ``use_libuv`` argument)."""
    if os.environ.get("USE_LIBUV", "") == "0":
        try:
            return dist.TCPStore(addr, port, is_master=False, timeout=timeout, use_libuv=False)
        except TypeError:
            pass
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)


def _env_int(name, default):
    value = os.environ.get(name, "")
    return int(value) if value.lstrip("-").isdigit() else default


class Job:
    """The process group, the DDP wrapper and the in-place recovery of one worker.

    model: the module (not wrapped); optimizer, scheduler (an LR scheduler) and scaler (a
    GradScaler) are optional, and their state is what a replacement receives. start_step: the
    first step to run when every process is new (a checkpoint's step + 1; 0 without one).
    backend: "gloo", or "nccl" with CUDA (device: the module's device, default cuda:LOCAL_RANK
    for nccl, cpu for gloo). ddp_kwargs go to DistributedDataParallel. timeout: the process
    group's and the store client's, the bound on what no abort reaches (a group that forms
    with a silent member, a store that does not answer); in place, a collective blocked on a
    lost peer returns at the agent's abort instead. stuck_wait: how long a step's collectives
    may stay blocked after the agent's abort before this process gives up and exits (status
    STUCK_EXIT_CODE) for its agent to start the rank anew (at least; see DEFAULT_STUCK_WAIT).
    log: where the module says what it did (None: quiet)."""

    def __init__(self, model, optimizer=None, scheduler=None, scaler=None, start_step=0,
                 backend="gloo", device=None, ddp_kwargs=None,
                 timeout=datetime.timedelta(seconds=60), failure_wait=DEFAULT_FAILURE_WAIT,
                 world_wait=DEFAULT_WORLD_WAIT, stuck_wait=DEFAULT_STUCK_WAIT, log=sys.stdout):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.module, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.backend = backend
        self.local_rank = _env_int("LOCAL_RANK", 0)
        if device is None:
            device = torch.device("cuda", self.local_rank) if backend == "nccl" else torch.device("cpu")
        self.device = device
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._timeout = timeout
        self._failure_wait = failure_wait.total_seconds()
        self._world_wait = world_wait.total_seconds()
        self._log = log
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.round = _env_int("MUSTER_ROUND", 0)
        self.lost = []  # global ranks of the world before whose nodes left
        self.recoveries = 0
        self.model = None
        self._survivor = False  # this process has state from a world before the current one
        self._done = start_step - 1  # the last step this process completed
        self._failed = False
        self._resume_due = False
        fd = os.environ.get(_FD_VAR, "")
        # In place needs the agent's store: a store hosted by rank 0 would go with it.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
        self.in_place = fd.isdigit() and agent_store
        # The abort is pushed: the reader thread makes a collective blocked on a peer that went
        # silent (no FIN, no RST) return now, not after the group's timeout (_abort_group).
        self._group_sockets = set()  # the inodes of the current group's sockets (and store's)
        self._join_before = None  # during a join: the inodes that were open before it
        # The world (the channel's epoch it came with) that the join under way, or the group
        # formed, belongs to: a message of that world or older must not shut their sockets
        # (the world message itself arrives on the reader thread as the main thread, woken by
        # it, may already be joining it).
        self._sockets_epoch = 0
        self._watch = _StuckWatch(stuck_wait.total_seconds(), self._give_up)
        self._channel = _Channel(int(fd), self._on_abort) if self.in_place else None
        self._seen = self._channel.epoch() if self._channel else 0
        if self.in_place:
            _prefetch()
            addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT", 0)
            if self._seen != 0:  # the world moved on before this process joined it
                addr, port = self._adopt(self._channel.await_world(self.round, self._world_wait))
            self._next = self._form(addr, port)
            # A new process (a replacement, a taken spare, a newcomer) answers for its first
            # round too: its agent waits for every worker's answer after a re-form.
            self._resume_due = True
            self.say("rank %d: pid %d in place, round %d" % (self.rank, os.getpid(), self.round))
        else:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
            self._next = self._agree()
            self._wrap()

    # --- the training loop's side --------------------------------------------------------

    def steps(self, total):
        """The steps to run, from the agreed one up to `total` - 1; a step that failed for a
        world change is given again once the new world agreed where to go on."""
        step = self._next
        while step < total:
            if self._channel and self._channel.epoch() != self._seen:
                step = self._recover("the agent said the world changed")
                continue
            self._failed = False
            yield step
            if self._failed:
                step = self._recover("a collective failed")
                continue
            self._done = step
            # Not for a world the agent has left already (the next world's recovery answers
            # for that one; an answer that crosses the abort is ignored by the agent).
            if self._resume_due and self._channel.epoch() == self._seen:
                self._resume_due = False
                self._channel.resumed(self.round)
            step += 1

    def step(self):
        """A context for one step's body: in place, an error that a world change explains is
        kept for the recovery (the step runs again), any other is raised."""
        return _StepGuard(self)

    def say(self, text):
        if self._log is not None:
            print(text, file=self._log, flush=True)

    # --- the recovery ----------------------------------------------------------------------

    def _recover(self, why):
        start = time.monotonic()
        old_rank = self.rank
        self._leave()
        self._survivor = True
        step = self._form(*self._adopt(self._channel.await_world(self.round, self._world_wait)))
        self.recoveries += 1
        self._resume_due = True
        self.say("rank %d: pid %d re-formed in place as rank %d of %d, round %d (lost: %s) "
                 "after %s, in %.0f ms" % (old_rank, os.getpid(), self.rank, self.world_size,
                                          self.round, ",".join(map(str, self.lost)) or "-", why,
                                          (time.monotonic() - start) * 1000))
        return step

    def _form(self, addr, port):
        """Joins the adopted world's group, agrees on the state, wraps DDP; the step to run
        next. A loss while this goes on (the agent's abort ends a join or a collective) makes
        the agent's next world the one to form; any other failure is a RecoveryError."""
        while True:
            seen = self._seen
            try:
                self._join(addr, port)
                self._watch.enter(seen)
                try:
                    step = self._agree()
                    self._wrap()
                finally:
                    self._watch.leave()
                return step
            except Exception as e:
                self._leave()
                if not self._channel.wait_change(seen, self._failure_wait):
                    raise RecoveryError("in-place re-form of round %d failed: %s: %s"
                                        % (self.round, type(e).__name__, e)) from e
                addr, port = self._adopt(self._channel.await_world(self.round, self._world_wait))

    def _adopt(self, got):
        """The agent's world message (await_world's) as this process's world; its store."""
        world, self._seen = got
        self.round = int(world["round"])
        self.rank = int(world["rank"])
        self.world_size = int(world["world_size"])
        self.local_rank = int(world.get("local_rank", self.local_rank))
        lost = world.get("lost", "")
        self.lost = [int(r) for r in lost.split(",")] if lost else []
        return world["master_addr"], int(world["master_port"])

    def _on_abort(self, epoch):
        """On the reader thread, at the agent's abort (or world) that made `epoch`."""
        self._abort_group(epoch)
        self._watch.aborted(epoch)

    def _give_up(self, waited):
        """On the watch's timer: a collective still blocked `waited` s after the abort, which
        nothing in this process can end (_StuckWatch). The process exits; its agent starts the
        rank anew, and the others re-form with it."""
        why = ("gloo never fails a send it queued on a connection its peer reset"
               if self.backend == "gloo" else "the process group's abort did not end it")
        print("rank %d: pid %d still blocked %.1f s after the agent's abort (a collective: %s); "
              "exiting %d so that the agent starts this rank anew"
              % (self.rank, os.getpid(), waited, why, STUCK_EXIT_CODE),
              file=sys.stderr, flush=True)
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is not None:  # where: the call that blocks is the last line
            import traceback
            print("rank %d: where it was blocked:\n%s" % (self.rank, "".join(
                traceback.format_stack(frame)).rstrip()), file=sys.stderr, flush=True)
        os._exit(STUCK_EXIT_CODE)

    def _abort_group(self, epoch):
        """On the reader thread, at the agent's abort. gloo (which torch cannot abort): shut
        down the group's own connections (never its listening socket: _shut_connection), so
        that a blocked recv or send returns at once and the collective raises; the group is
        destroyed at the step's end anyway. (torch 2.x has ProcessGroupGloo.abort(), but it does
        not end a collective blocked on a silent peer: measured on 2.14, the allreduce returned
        only when the peer's process exited.) NCCL: torch's
        _abort_process_group where it has it (torch >= 2.6). Only for a message (`epoch`) newer
        than the world the join or group belongs to."""
        joining = self._join_before  # a join under way: every socket it opened so far
        if self._sockets_epoch >= epoch:
            return  # they belong to this message's world (or a later one)
        if self.backend == "nccl" and joining is None:
            abort = getattr(self._dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None and self._dist.is_initialized():
                try:
                    abort()
                except Exception:
                    pass
            return
        for fd, inode in _socket_fds().items():
            if inode in self._group_sockets or (joining is not None and inode not in joining):
                _shut_connection(fd)

    def _leave(self):
        """Out of the broken group: its sockets close, so peers blocked on this rank fail now."""
        self.model = None
        dist = self._dist
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        if not dist.is_initialized():
            # A join that failed part-way has moved torch's group counter on, and torch puts it
            # back only when it destroys a default group: the next group's names and its
            # store-based barrier key would then not be the other ranks' (a new process starts
            # at 0), and that barrier would wait for its whole timeout.
            c10d = dist.distributed_c10d
            if hasattr(c10d, "_group_count"):  # torch 1.x
                c10d._group_count = 0
            world = getattr(c10d, "_world", None)
            if world is not None and hasattr(world, "group_count"):  # torch 2.x
                world.group_count = 0

    def _join(self, addr, port):
        dist = self._dist
        before = set(_socket_fds().values())
        # From here an abort ends the join: it shuts every socket the join opened (the store
        # client's, the group's so far), so a join blocked on a world that moved on returns.
        self._sockets_epoch = self._seen
        self._join_before = before
        try:
            if self._channel.epoch() != self._seen:
                raise RecoveryError("the world changed before round %d formed" % self.round)
            store = _tcpstore(dist, addr, port, self._timeout)
            # An abort between the check above and the store's socket shut nothing: look again
            # now that the socket is there (an abort from here on shuts it).
            if self._channel.epoch() != self._seen:
                raise RecoveryError("the world changed before round %d formed" % self.round)
            prefixed = dist.PrefixStore("%s/r%d/" % (_PREFIX, self.round), store)
            dist.init_process_group(self.backend, store=prefixed, rank=self.rank,
                                    world_size=self.world_size, timeout=self._timeout)
            self._group_sockets = set(_socket_fds().values()) - before
        finally:
            self._join_before = None

    def _agree(self):
        """Every rank's last completed step, gathered; the most advanced survivor's state goes
        to every rank that lacks it. The step to run next."""
        torch, dist = self._torch, self._dist
        mine = torch.tensor([self._done, 1 if self._survivor else 0], dtype=torch.int64,
                            device=self.device)
        seen = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(seen, mine)
        ranks = [(int(t[0]), bool(t[1])) for t in seen]
        pool = [r for r, (_, survivor) in enumerate(ranks) if survivor] or list(range(len(ranks)))
        best = max(ranks[r][0] for r in pool)
        src = min(r for r in pool if ranks[r][0] == best)
        # Survivors of one world hold the same state (DDP keeps it so) when their steps agree;
        # a new process, or a survivor a step behind, needs it. A job whose every process is
        # new agrees from its checkpoint, and DDP's own start broadcasts rank 0's module.
        if len(pool) < len(ranks) or any(done != best for done, _ in ranks):
            self._send_state(src)
        self._done = best
        return best + 1

    def _send_state(self, src):
        torch, dist = self._torch, self._dist
        with torch.no_grad():
            for t in self.module.state_dict().values():
                if torch.is_tensor(t):
                    dist.broadcast(t, src)
        state = [None]
        if self.rank == src:
            state[0] = {
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "scaler": self.scaler.state_dict() if self.scaler else None,
            }
        dist.broadcast_object_list(state, src, device=self.device if self.backend == "nccl" else None)
        if self.rank != src:
            s = state[0]
            if self.optimizer and s["optimizer"] is not None:
                self.optimizer.load_state_dict(s["optimizer"])
            if self.scheduler and s["scheduler"] is not None:
                self.scheduler.load_state_dict(s["scheduler"])
            if self.scaler and s["scaler"] is not None:
                self.scaler.load_state_dict(s["scaler"])

    def _wrap(self):
        from torch.nn.parallel import DistributedDataParallel as DDP

        kwargs = dict(self._ddp_kwargs)
        if self.backend == "nccl":
            kwargs.setdefault("device_ids", [self.device])
        self.model = DDP(self.module, **kwargs)


class _StepGuard:
    def __init__(self, job):
        self._job = job

    def __enter__(self):
        self._job._watch.enter(self._job._seen)
        return self

    def __exit__(self, kind, value, tb):
        job = self._job
        job._watch.leave(step_done=kind is None)
        if kind is None or not job.in_place or not issubclass(kind, Exception) or \
                isinstance(value, RecoveryError):
            return False
        # A world change explains it when the agent says so, now or within failure_wait.
        if job._channel.epoch() == job._seen and \
                not job._channel.wait_change(job._seen, job._failure_wait):
            return False
        job._failed = True
        return True
