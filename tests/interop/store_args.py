"""What the suite's scripts pass to every TCPStore they make: ``use_libuv=False`` under
USE_LIBUV=0, as torch's own env:// honours it (Debian builds torch 2.x without libuv, and a
TCPStore asks for libuv by default there: tests/support/in_torch_root.sh sets USE_LIBUV=0).
Torch 1.x has no such argument, and the suite never sets the variable for it."""
import os

LIBUV = {"use_libuv": False} if os.environ.get("USE_LIBUV") == "0" else {}
