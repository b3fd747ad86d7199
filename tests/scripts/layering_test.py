#!/usr/bin/env python3
"""The rooms of docs/architecture.md, checked: no product source includes a room above its own,
the client side of the rendezvous includes nothing of its server side, and project headers
include each other without a cycle.

    layering_test.py SOURCE_DIR

Exits 0 and prints "layering_test: ok (N files, M includes)", or 1 with one line per broken rule.
A self-check first: a made-up include from ops/ up to the agent must be reported.
"""
import os
import re
import sys

# Room of a source path (the first matching prefix) -> the rooms it may include.
ROOMS = [
    ("ops/", "ops", {"ops"}),
    ("rendezvous/", "rendezvous", {"ops", "rendezvous", "v1"}),
    ("worker_runtime/", "worker", {"ops", "rendezvous", "worker", "v1"}),
    ("status/", "status", {"ops", "rendezvous", "status", "v1"}),
    ("agent/", "agent", {"ops", "rendezvous", "agent", "v1"}),
    ("rdzvd/", "rdzvd", {"ops", "rendezvous", "status", "v1"}),
    ("launcher/", "launcher", {"ops", "rendezvous", "status", "agent", "launcher", "v1"}),
    ("examples/", "examples", {"ops", "rendezvous", "worker", "v1"}),
]

# The rendezvous client side (muster_rendezvous_client: src/client/, src/common/ and these of
# src/store/): these may include only each other.
CLIENT_SOURCES = {"client.cc", "grpc_store.cc", "kv_table.cc", "memory_store.cc", "resolve.cc",
                  "tls.cc", "stall.cc"}
CLIENT_HEADERS = {"client.h", "grpc_store.h", "kv_table.h", "memory_store.h",
                  "resolve.h", "tls.h", "limits.h", "store.h", "prefix_store.h",
                  "timeouts.h", "status_convert.h", "stall.h", "local_session.h",
                  "store_relay.h", "credentials.h"}
# What the worker runtime and the agent may include of the rendezvous: both link the client
# side only (a training program, and an agent, never link the server).
CLIENT_ONLY_ROOMS = {"worker", "agent"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def room_of(rel):
    for prefix, room, allowed in ROOMS:
        if rel.startswith(prefix):
            return room, allowed
    return None, None


def product_files(root):
    for top, _, _ in ROOMS:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for n in names:
                if n.endswith((".cc", ".h", ".cu")):
                    full = os.path.join(dirpath, n)
                    yield os.path.relpath(full, root), full


def check(files):
    """files: {rel: text}. Returns (problems, includes counted)."""
    problems, count = [], 0
    headers = {}  # resolved header rel -> its includes (resolved rels), for the cycle check
    for rel, text in sorted(files.items()):
        room, allowed = room_of(rel)
        resolved = []
        for inc in INCLUDE.findall(text):
            count += 1
            m = re.match(r"muster/([a-z0-9_]+)/(.+)", inc)
            if m:
                target_room, name = m.group(1), m.group(2)
                if target_room not in allowed:
                    problems.append(f"{rel}: includes {inc}: room '{room}' may not include "
                                    f"'{target_room}' (docs/architecture.md)")
                if room in CLIENT_ONLY_ROOMS and target_room == "rendezvous" and name not in CLIENT_HEADERS:
                    problems.append(f"{rel}: includes {inc}: room '{room}' includes only the "
                                    f"rendezvous client side")
                base = os.path.basename(rel)
                client_side = (rel.startswith(("rendezvous/src/client/", "rendezvous/src/common/"))
                               or (rel.startswith("rendezvous/src/store/") and base in CLIENT_SOURCES)
                               or (os.path.dirname(rel) == "rendezvous/include/muster/rendezvous"
                                   and base in CLIENT_HEADERS))
                if client_side and target_room == "rendezvous" and name not in CLIENT_HEADERS:
                    problems.append(f"{rel}: includes {inc}: the rendezvous client side includes "
                                    f"its server side")
                for prefix, r, _ in ROOMS:
                    if r == target_room or (r == "worker" and target_room == "worker"):
                        cand = os.path.join(prefix, "include", inc)
                        if cand in files:
                            resolved.append(cand)
            elif not inc.startswith(("absl/", "muster/v1/", "grpc", "google/")):
                # Beside the file, or (the rendezvous' private headers) from its src/ by room.
                for base_dir in (os.path.dirname(rel), "rendezvous/src"):
                    cand = os.path.normpath(os.path.join(base_dir, inc))
                    if cand in files:
                        resolved.append(cand)
                        break
                if (room == "rendezvous"
                        and rel.startswith(("rendezvous/src/client/", "rendezvous/src/common/"))
                        and not inc.startswith(("client/", "common/"))):
                    problems.append(f"{rel}: includes {inc}: the rendezvous client side includes "
                                    f"its server side")
        headers[rel] = resolved
    # Cycles among project files (depth-first, colours).
    state = {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in headers.get(node, []):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                problems.append("include cycle: " + " -> ".join(cycle))
            elif state.get(nxt) is None:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(headers):
        if state.get(node) is None:
            visit(node, [])
    return problems, count


def main():
    root = sys.argv[1]
    # The check must be able to fail: a made-up arrow back up, a made-up cycle, and an agent
    # that reaches the rendezvous server.
    fake = {"ops/src/x.cc": '#include "muster/agent/agent.h"\n',
            "agent/src/a.h": '#include "b.h"\n', "agent/src/b.h": '#include "a.h"\n',
            "agent/src/c.cc": '#include "muster/rendezvous/server.h"\n'}
    bad, _ = check(fake)
    if (not any("may not include 'agent'" in p for p in bad) or not any("cycle" in p for p in bad)
            or not any("includes only the rendezvous client side" in p for p in bad)):
        print("layering_test: FAILED: the self-check found nothing wrong in a made-up bad tree")
        return 1
    files = {}
    for rel, full in product_files(root):
        with open(full, encoding="utf-8", errors="replace") as f:
            files[rel] = f.read()
    problems, count = check(files)
    for p in problems:
        print("layering_test: " + p)
    if problems:
        print(f"layering_test: FAILED: {len(problems)} problems")
        return 1
    print(f"layering_test: ok ({len(files)} files, {count} includes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
