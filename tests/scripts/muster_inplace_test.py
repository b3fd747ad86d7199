"""python/muster_inplace.py's control channel, without torch: a SOCK_SEQPACKET pair stands for
the agent (ops/control_channel.h is the contract). The hello goes out first; abort and world
messages move the epoch and wake a waiter at once; malformed messages are refused and change
nothing; a world for an older round is not the one awaited; `resumed` is answered; a closed
channel ends the wait with RecoveryError; await_rank() declares spares and a spare takes its
rank's variables from `take`, importing what a first DDP imports while it waits; the stuck watch
reports a step still open after the wait that follows an abort, and nothing else; an abort
shuts a group's connections but never its listening socket; the store client honours
USE_LIBUV=0 where torch takes the argument. Exit 0 when every check holds.

  python3 tests/scripts/muster_inplace_test.py PYTHON_DIR
"""
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, sys.argv[1])
import muster_inplace as mi  # noqa: E402

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


# The parser: the contract's shape, and what it refuses.
check(mi._parse(b"abort round=3") == ("abort", {"round": "3"}), "parse: abort round=3")
check(mi._parse(b"world round=2 rank=1 world_size=3 lost=4,5")[1]["lost"] == "4,5", "parse: lost list")
for bad in (b"", b"world round", b"world =1", b"world round=", b"w\x00rld", b"\xff abort",
            b"abort " + b"x" * 1100 + b"=1"):
    check(mi._parse(bad) is None, "parse refuses %r" % bad[:24])

agent, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
ch = mi._Channel(os.dup(worker.fileno()))
worker.close()
check(agent.recv(2048) == b"hello in_place=1", "the worker says hello first")
check(ch.epoch() == 0, "no message yet: epoch 0")

# Malformed and unknown messages change nothing.
agent.send(b"world round")
agent.send(b"dance round=1")
check(not ch.wait_change(0, 0.2), "refused messages do not wake a waiter")

# An abort wakes a waiter at once (no polling interval).
woke = []
t = threading.Thread(target=lambda: woke.append((ch.wait_change(0, 10), time.monotonic())))
sent = time.monotonic()
t.start()
agent.send(b"abort round=2")
t.join()
check(woke and woke[0][0], "abort moves the epoch")
check(woke and woke[0][1] - sent < 0.5, "the waiter woke within 0.5 s of the abort (%.3f s)"
      % (woke[0][1] - sent if woke else -1))

# A world for an older round is not the one awaited; the next one is.
agent.send(b"world round=1 rank=0 world_size=2 master_addr=h master_port=1")
agent.send(b"world round=2 rank=1 world_size=2 local_rank=0 master_addr=h master_port=29400 lost=3")
w, epoch = ch.await_world(1, 5)
check(epoch == ch.epoch(), "await_world gives the epoch its world came with")
check(w["round"] == "2" and w["rank"] == "1" and w["lost"] == "3", "await_world(1) returns round 2's world")
try:
    ch.await_world(2, 0.2)
    check(False, "no world after round 2: await_world times out")
except mi.RecoveryError as e:
    check("within" in str(e), "no world after round 2: RecoveryError (%s)" % e)
# An abort after a world that is still to be taken: the world is stale, and its epoch says so
# (a join of it must fail at once, not wait for peers the abort says are gone).
agent.send(b"world round=3 rank=0 world_size=2 master_addr=h master_port=1")
check(ch.wait_change(epoch, 5), "the world of round 3 came")
at_world = ch.epoch()
agent.send(b"abort round=4")
check(ch.wait_change(at_world, 5), "the abort after it came")
w3, epoch3 = ch.await_world(2, 5)
check(w3["round"] == "3" and epoch3 == at_world and epoch3 != ch.epoch(),
      "a world taken after a later abort comes with its own epoch, not the abort's (%d, now %d)"
      % (epoch3, ch.epoch()))

try:
    ch.await_world(3, 0.2)
    check(False, "no world after round 3: await_world times out")
except mi.RecoveryError as e:
    check("within" in str(e), "no world after round 3: RecoveryError (%s)" % e)

ch.resumed(2)
check(agent.recv(2048) == b"resumed round=2", "resumed round=2 is sent")

# Messages queued before the worker listened are taken before the constructor returns.
a2, w2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
a2.send(b"abort round=3")
a2.send(b"world round=3 rank=0 world_size=1 master_addr=h master_port=1")
ch2 = mi._Channel(os.dup(w2.fileno()))
w2.close()
check(ch2.epoch() == 2, "an abort and a world sent before the hello are seen at once (epoch %d)" % ch2.epoch())
check(a2.recv(2048) == b"hello in_place=1", "the hello still goes out")
a2.close()

# The abort hook (NCCL's group abort) runs on the reader thread when an abort comes.
a3, w3 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
hooked = threading.Event()
hook_epochs = []
ch3 = mi._Channel(os.dup(w3.fileno()),
                  on_abort=lambda epoch: (hook_epochs.append(epoch), hooked.set()))
w3.close()
a3.send(b"abort round=5")
check(hooked.wait(10), "an abort calls the abort hook")
hooked.clear()
a3.send(b"world round=5 rank=0 world_size=1 master_addr=h master_port=1")
check(hooked.wait(10), "a world message calls it too (it ends the world before, as an abort)")
check(hook_epochs == [1, 2], "the hook is given the epoch each message made (%s)" % hook_epochs)
a3.close()

# Job._abort_group shuts the sockets of a group (or join) only for a message newer than the
# world they belong to: the world message of the world being joined, which reaches the reader
# thread as the main thread (woken by it) may already be joining, leaves them open.
class _FakeJob:
    backend = "gloo"
    _join_before = None


def _is_shut(sock):
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def check_epoch_gate(what, place):
    """`place(fake, inode)` makes the socket's inode one of the group's or of a join's."""
    sock, other = socket.socketpair()
    fake = _FakeJob()
    place(fake, os.readlink("/proc/self/fd/%d" % sock.fileno())[8:-1])
    fake._sockets_epoch = 4
    mi.Job._abort_group(fake, 4)
    check(not _is_shut(sock),
          "abort_group: the message of their own world leaves the %s open" % what)
    mi.Job._abort_group(fake, 5)
    check(_is_shut(sock), "abort_group: a newer message shuts the %s" % what)
    sock.close()
    other.close()


def _in_group(fake, inode):
    fake._group_sockets, fake._join_before = {inode}, None


def _in_join(fake, inode):  # every other socket was open before the join
    fake._group_sockets, fake._join_before = set(), set(mi._socket_fds().values()) - {inode}


check_epoch_gate("group's sockets", _in_group)
check_epoch_gate("join's sockets", _in_join)


# A group's listening socket is never shut (gloo's listener thread in torch 2.x aborts the
# process when its accept fails): the abort shuts the group's connections and leaves the
# listener accepting.
def check_listener_kept():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    conn = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    fake = _FakeJob()
    fake._group_sockets = {os.readlink("/proc/self/fd/%d" % s.fileno())[8:-1]
                           for s in (listener, conn)}
    fake._sockets_epoch = 4
    mi.Job._abort_group(fake, 5)
    check(_is_shut(conn), "abort_group: the group's connection is shut")
    check(listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1,
          "abort_group: the group's listening socket still listens")
    late = socket.socket()
    listener.settimeout(5)
    try:
        late.connect(listener.getsockname())
        accepted, _ = listener.accept()
        accepted.close()
        check(True, "abort_group: the listener still accepts a connection after the abort")
    except OSError as e:
        check(False, "abort_group: the listener still accepts a connection after the abort (%s)" % e)
    for s in (late, peer, conn, listener):
        s.close()


check_listener_kept()


# The store client honours USE_LIBUV=0 (torch 2.x built without libuv), and a torch without the
# argument (1.x: pybind raises TypeError) gets the call without it.
class _FakeDist:
    def __init__(self, takes_libuv):
        self.calls = []
        self._takes_libuv = takes_libuv

    def TCPStore(self, addr, port, **kw):  # noqa: N802 (torch's name)
        self.calls.append(dict(kw))
        if "use_libuv" in kw and not self._takes_libuv:
            raise TypeError("TCPStore(): incompatible function arguments")
        return "store"


timeout = object()
for var, takes, want in (("0", True, [False]), ("0", False, [False, None]), (None, True, [None]),
                         ("1", True, [None])):
    if var is None:
        os.environ.pop("USE_LIBUV", None)
    else:
        os.environ["USE_LIBUV"] = var
    fake = _FakeDist(takes)
    got = mi._tcpstore(fake, "h", 1, timeout)
    asked = [c.get("use_libuv") for c in fake.calls]
    check(got == "store" and asked == want and all(c["timeout"] is timeout for c in fake.calls),
          "store client: USE_LIBUV=%s, use_libuv %s: asked %s" % (var, "taken" if takes else "unknown",
                                                                 asked))
os.environ.pop("USE_LIBUV", None)

# The agent goes: a waiter ends with RecoveryError, not a hang.
agent.close()
try:
    ch.await_world(3, 10)
    check(False, "a closed channel ends the wait")
except mi.RecoveryError as e:
    check("closed" in str(e), "a closed channel ends the wait with RecoveryError (%s)" % e)

# await_rank (warm spares): a worker says it can wait as a spare and goes on; a spare waits
# until `take`, which sets its environment; the descriptor stays open for Job's channel.
# A spare imports what a process's first DDP imports (torch 2.x's torch._dynamo) before it says
# it is ready; a worker does not wait for that. A module of the test's stands for it.
warm_dir = tempfile.mkdtemp()
with open(os.path.join(warm_dir, "muster_test_first_ddp.py"), "w") as f:
    f.write("")
sys.path.insert(0, warm_dir)
mi._FIRST_DDP_IMPORTS = ("muster_test_first_ddp", "muster_no_such_module")
a4, w4 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
os.environ["MUSTER_CONTROL_FD"] = str(w4.fileno())
os.environ.pop("MUSTER_SPARE", None)
check(mi.await_rank() is False, "await_rank in a worker returns at once")
check(a4.recv(2048) == b"hello spare=1", "it says the program can wait as a spare")
check("muster_test_first_ddp" not in sys.modules and mi._prefetching is None,
      "a worker imports nothing more there")
os.environ["MUSTER_SPARE"] = "1"
os.environ.pop("RANK", None)
took = []
t = threading.Thread(target=lambda: took.append(mi.await_rank()))
t.start()
check(a4.recv(2048) == b"hello spare=1", "a spare says it is ready")
check(mi._prefetching is not None, "a spare starts its warm-up import")
mi._prefetching.join(10)
check("muster_test_first_ddp" in sys.modules,
      "a spare imports what the first DDP imports while it waits (a missing one skipped)")
time.sleep(0.1)
check(t.is_alive(), "a spare waits until it is given a rank")
a4.send(b"world round=9 rank=0 world_size=1 master_addr=h master_port=1")  # not its message
a4.send(b"take RANK=5 LOCAL_RANK=1 MUSTER_ROUND=3")
t.join(10)
check(took == [True] and os.environ.get("RANK") == "5" and os.environ.get("LOCAL_RANK") == "1"
      and os.environ.get("MUSTER_ROUND") == "3", "take sets the rank's variables")
check("MUSTER_SPARE" not in os.environ, "and the process is no spare any more")
w4.send(b"still open")
check(a4.recv(2048) == b"still open", "the channel's descriptor is still open for Job")
a4.close()
w4.close()
del os.environ["MUSTER_CONTROL_FD"]

# _StuckWatch: a region (a step's body) still open when the wait after an abort ends is
# reported stuck, once; a region left in time, or an abort outside any region, is not. The
# wait is the minimum, or STUCK_STEP_FACTOR times the longest recent step (a fake clock).
now = [100.0]
stuck = []
fired = threading.Event()
watch = mi._StuckWatch(0.2, lambda waited: (stuck.append(waited), fired.set()),
                       clock=lambda: now[0])
check(watch.aborted(1) is None, "stuck watch: an abort outside a step arms nothing")
watch.enter(1)
check(watch.aborted(1) is None, "stuck watch: the message of the step's own world arms nothing")
t1 = watch.aborted(2)
watch.leave()
t1.join(5)
check(not stuck, "stuck watch: a step left before the wait is not stuck")
watch.enter(2)
t2 = watch.aborted(3)
check(fired.wait(5) and stuck == [0.2], "stuck watch: a step still open after the wait is stuck "
      "(%s)" % stuck)
t2.join(5)
watch.leave()
fired.clear()
watch.enter(3)
t3 = watch.aborted(4)
watch.leave()
watch.enter(4)  # a new step began before the timer fired: the old region is not this one
t3.join(5)
watch.leave()
check(len(stuck) == 1, "stuck watch: a step begun after the aborted one ended is not taken for it")
for d in (0.05, 0.4, 0.1):  # steps of these durations, on the fake clock
    watch.enter(4)
    now[0] += d
    watch.leave(step_done=True)
watch.enter(4)
now[0] += 30  # a failed step does not count
watch.leave()
check(abs(watch.wait() - mi.STUCK_STEP_FACTOR * 0.4) < 1e-9,
      "stuck watch: the wait is %d times the longest completed step (%.2f s)"
      % (mi.STUCK_STEP_FACTOR, watch.wait()))

print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
