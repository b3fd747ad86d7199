"""TCPStore conformance, driven by torch's own Python TCPStore client.

    tcpstore_conformance.py HOST PORT   checks the server at HOST:PORT (muster's)
    tcpstore_conformance.py --torch     checks torch's own server (TCPStore is_master=True)

The same checks either way, so that what the suite asks of muster's server is what torch's
own server does. Prints "conformance: ok (N checks)" and exits 0, or names the first check
that failed and exits 1.
"""
import datetime
import sys
import threading
import time

import torch.distributed as dist
from store_args import LIBUV

checks = 0


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        print(f"conformance: FAILED: {what}", flush=True)
        sys.exit(1)


def raises(fn, what):
    try:
        fn()
    except Exception as e:  # torch raises RuntimeError (DistStoreError in 2.x)
        check(True, what)
        return str(e)
    check(False, what + " (no error)")


def timeout(seconds):
    return datetime.timedelta(seconds=seconds)


def main():
    master = None
    if sys.argv[1:] == ["--torch"]:
        master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout(30), wait_for_workers=False, **LIBUV)
        host, port = "127.0.0.1", master.port
    else:
        host, port = sys.argv[1], int(sys.argv[2])

    def client(wait_s=30):
        return dist.TCPStore(host, port, None, False, timeout(wait_s), wait_for_workers=False, **LIBUV)

    s = client()
    base = s.num_keys()

    # set, get (bytes as they are), overwrite
    s.set("k", b"v1")
    check(s.get("k") == b"v1", "get returns what set wrote")
    s.set("k", b"\x00\xffbin\x00")
    check(s.get("k") == b"\x00\xffbin\x00", "a value is bytes, NULs included")
    s.set("empty", b"")
    check(s.get("empty") == b"", "an empty value")
    big = bytes(range(256)) * 4096  # 1 MiB
    s.set("big", big)
    check(s.get("big") == big, "a 1 MiB value round trips")

    # add: a missing key starts at 0; the value is the decimal text
    check(s.add("n", 5) == 5, "add on a missing key")
    check(s.add("n", -2) == 3, "add a negative delta")
    check(s.get("n") == b"3", "add stores decimal text")
    check(s.add("n", 0) == 3, "add 0 reads the count")

    # compare_set: c10d's rules, the missing-key cases included
    check(s.compare_set("cas", "", "first") == b"first", "compare_set on a missing key, expected ''")
    check(s.get("cas") == b"first", "... sets it")
    check(s.compare_set("cas", "wrong", "x") == b"first", "compare_set with a wrong expected value")
    check(s.get("cas") == b"first", "... leaves it")
    check(s.compare_set("cas", "first", "second") == b"second", "compare_set with the right one")
    before = s.num_keys()
    check(s.compare_set("nokey", "exp", "new") == b"exp", "compare_set on a missing key, expected "
          "not '': answers the expected value")
    check(s.num_keys() == before, "... and does not set it")

    # delete_key, num_keys (torch 1.13's Python client has no check())
    check(s.num_keys() == base + 5, f"num_keys counts every key ({s.num_keys()} vs {base + 5})")
    check(s.delete_key("cas") is True, "delete_key of a present key")
    check(s.delete_key("cas") is False, "delete_key of a missing key")
    check(s.num_keys() == base + 4, "num_keys after a delete")
    check(s.compare_set("cas", "", "again") == b"again", "a deleted key is gone (compare_set "
          "sets it as a missing one)")

    # wait and get block until another client writes; they are woken by that write
    other = client()
    def late():
        time.sleep(0.2)
        other.set("late1", b"a")
        other.add("late2", 1)
    t = threading.Thread(target=late)
    t.start()
    t0 = time.monotonic()
    s.wait(["late1", "late2"])
    check(time.monotonic() - t0 < 20, "wait returns once both keys are written")
    t.join()
    t = threading.Thread(target=lambda: (time.sleep(0.2), other.set("late3", b"z")))
    t.start()
    check(s.get("late3") == b"z", "get waits for a key another client sets")
    t.join()
    s.wait(["k"])  # present: at once
    check(True, "wait on present keys")

    # a wait or get that times out raises (each on a client of its own: torch's client does
    # not read the late answer of a wait it gave up on)
    w = client(wait_s=1)
    t0 = time.monotonic()
    raises(lambda: w.wait(["never"], timeout(0.3)), "wait on a missing key times out")
    check(time.monotonic() - t0 < 10, "... after its timeout")
    g = client(wait_s=1)
    raises(lambda: g.get("never-either"), "get of a missing key times out (the store timeout)")

    # add to a value that is not an integer: an error for that client, the store goes on
    bad = client()
    bad.set("text", b"abc")
    raises(lambda: bad.add("text", 1), "add to a non-integer value")
    check(s.get("k") == b"\x00\xffbin\x00", "the store still serves other clients")
    check(s.add("n", 1) == 4, "... and their adds")

    # many clients at once count every add
    def adder():
        c = client()
        for _ in range(50):
            c.add("counter", 1)
    threads = [threading.Thread(target=adder) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    check(s.add("counter", 0) == 400, "8 clients x 50 adds")

    print(f"conformance: ok ({checks} checks)", flush=True)


main()
