#!/usr/bin/python3
"""Two builds' TCPStore fronts side by side (issue 57, bench/README.md "Rooms again"): torch's
own client, set+get, through an agent's relay (bench/relay_serve on loopback, then rdzvd) and
against the server's TCPStore-protocol store reached directly (rdzvd), one build then the
other, alternated every round (the first build first in odd rounds), 1, 4 and 16 client
processes. Prints each round's ops/s and, per row, both builds' medians and their ratio
(NEW / OLD): a change to the store's code is not slower when that is about 1.

    bench/store_ab.py OLD_BUILD NEW_BUILD [--rounds N] [--ops N]

Needs Debian's python3-torch (torch's client, bench/tcpstore_client.py). Run it with nothing
else on the machine.
"""
import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def load_run():
    """bench/run (no .py suffix) as a module: its servers and its client driver."""
    loader = importlib.machinery.SourceFileLoader("bench_run", os.path.join(HERE, "run"))
    spec = importlib.util.spec_from_loader("bench_run", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--ops", type=int, default=2000, help="set+get pairs per client process")
    a = ap.parse_args()
    run = load_run()
    client = os.path.join(HERE, "tcpstore_client.py")
    builds = {"old": types.SimpleNamespace(build=os.path.abspath(a.old)),
              "new": types.SimpleNamespace(build=os.path.abspath(a.new))}
    fronts = {"through its agent's relay": lambda b: run.start_relayed(b),
              "the server's store directly": lambda b: run.start_tcpstore(b)}
    got = {}  # (front, clients, build) -> [ops/s]
    for r in range(a.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for clients in (1, 4, 16):
            for front, start in fronts.items():
                for name in order:
                    srv, port = start(builds[name])
                    try:
                        ops = run.run_store_clients(
                            [["/usr/bin/python3", client, "client", str(port), str(a.ops),
                              f"c{c}-{r}"] for c in range(clients)])
                    finally:
                        if srv.stdin:
                            srv.stdin.close()
                        run.stop(srv)
                    got.setdefault((front, clients, name), []).append(ops)
                    print(f"round {r}: {clients:2d} process(es), {front}, {name}: {ops:,.0f} ops/s",
                          flush=True)
    print(f"\n| row (median of {a.rounds}) | old | new | new / old |")
    print("|---|---|---|---|")
    for clients in (1, 4, 16):
        for front in fronts:
            o = statistics.median(got[(front, clients, "old")])
            n = statistics.median(got[(front, clients, "new")])
            print(f"| {clients} process(es), {front} | {o:,.0f} ops/s | {n:,.0f} ops/s | {n / o:.2f}x |")


if __name__ == "__main__":
    main()
