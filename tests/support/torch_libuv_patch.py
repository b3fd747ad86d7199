"""Makes a torch built without libuv (Debian's 2.x) behave as a libuv build run with USE_LIBUV=0
(tests/support/torch_root.sh): every TCPStore that torch's own rendezvous code makes without
saying use_libuv gets ``use_libuv=(USE_LIBUV != "0")``, as torch's env:// already does. A
libuv build (pip's) asks for libuv there and works; Debian's refuses, so without this torchrun
and the agent-store client fail as shipped. Idempotent; prints what it changed.

    python3 torch_libuv_patch.py TORCH_DIR
"""
import os
import sys

FILES = ["distributed/rendezvous.py",
         "distributed/elastic/rendezvous/c10d_rendezvous_backend.py",
         "distributed/elastic/rendezvous/dynamic_rendezvous.py",
         "distributed/elastic/rendezvous/static_tcp_rendezvous.py",
         "distributed/elastic/agent/server/api.py"]
ARG = '__import__("os").environ.get("USE_LIBUV", "1") != "0"'
MARK = "# muster test root: USE_LIBUV honoured"


def patch(text):
    out, i, n = [], 0, 0
    while True:
        j = text.find("TCPStore(", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out), n
        k = j + len("TCPStore(")
        depth = 1
        while depth:  # the call's closing parenthesis
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            k += 1
        call = text[j:k]
        prev = text[max(0, j - 6):j]
        if "use_libuv" in call or prev.endswith(("def ", "class ")) or "import" in text[text.rfind("\n", 0, j):j]:
            out.append(text[i:k])
        else:
            body = call[:-1].rstrip()
            sep = " " if body.endswith(",") or body.endswith("(") else ", "
            out.append(text[i:j] + body + sep + "use_libuv=" + ARG + ")")
            n += 1
        i = k


def main():
    torch_dir = sys.argv[1]
    for rel in FILES:
        path = os.path.join(torch_dir, rel)
        if not os.path.exists(path):
            continue
        text = open(path).read()
        if MARK in text:
            continue
        new, n = patch(text)
        if n:
            open(path, "w").write(new.rstrip("\n") + "\n" + MARK + "\n")
            print("%s: %d TCPStore call(s) honour USE_LIBUV" % (rel, n))


if __name__ == "__main__":
    main()
