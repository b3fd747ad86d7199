"""muster's wheel, made from a build tree (docs/operations.md, "Installing: pip").

A PEP 517 backend (pyproject.toml names it, so `pip wheel .` works) and a command:

    python3 packaging/wheel/muster_wheel.py BUILD_DIR OUT_DIR    # prints the wheel's path

What goes in, from BUILD_DIR (launch and rdzvd built: self-contained, cmake/static_deps.cmake)
and python/:
- the binaries, stripped, as the environment's commands muster-launch and muster-rdzvd
  (<name>.data/scripts: pip copies them to the venv's or conda env's bin/ as they are, so they
  start as fast as the build tree's; no Python in front of them), and muster-torchrun-standin;
- the Python modules importable from that environment (muster_inplace, muster_progress,
  muster_progress_auto), and the hang hook where launch looks for it, <prefix>/lib/muster/python
  (launcher/python.cc: <bin>/../lib/muster/python).
Tag manylinux_2_34_x86_64: every ELF file needs only the manylinux libraries and no glibc
symbol newer than GLIBC_2.34; check_elf() refuses to make the wheel otherwise.
"""
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "muster"
TAG = "py3-none-manylinux_2_34_x86_64"
# What an ELF file of the wheel may need outside it (PEP 600's manylinux set, less the X11
# and GL libraries nothing here uses), and the newest glibc symbol version it may name.
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                  "ld-linux-x86-64.so.2", "libgcc_s.so.1", "libstdc++.so.6"}
MAX_GLIBC = (2, 34)
MAX_GLIBCXX = (3, 4, 30)


def version():
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    return re.search(r"project\(muster VERSION ([0-9.]+)", text).group(1)


def check_elf(path):
    """Problems of one ELF file against the tag, as lines (empty: fine)."""
    dyn = subprocess.run(["objdump", "-p", path], capture_output=True, text=True, check=True).stdout
    problems = [f"{path}: needs {lib}" for lib in re.findall(r"NEEDED\s+(\S+)", dyn)
                if lib not in ALLOWED_NEEDED]
    syms = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    for v in set(re.findall(r"\bGLIBC_([0-9.]+)", syms)):
        if tuple(int(x) for x in v.split(".")) > MAX_GLIBC:
            problems.append(f"{path}: a symbol of GLIBC_{v} (newer than GLIBC_2.34)")
    for v in set(re.findall(r"\bGLIBCXX_([0-9.]+)", syms)):
        if tuple(int(x) for x in v.split(".")) > MAX_GLIBCXX:
            problems.append(f"{path}: a symbol of GLIBCXX_{v} (newer than GLIBCXX_3.4.30)")
    return problems


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(build_dir, out_dir):
    """Writes the wheel into out_dir; returns its file name."""
    ver = version()
    data = f"{NAME}-{ver}.data"
    info = f"{NAME}-{ver}.dist-info"
    binaries = {"launch": os.path.join(build_dir, "launcher", "launch"),
                "rdzvd": os.path.join(build_dir, "rendezvous", "rdzvd")}
    files = []  # (name in the wheel, bytes, executable)
    with tempfile.TemporaryDirectory() as tmp:
        problems = []
        for tool, path in binaries.items():
            if not os.access(path, os.X_OK):
                raise SystemExit(f"muster_wheel: no {path}: build launch and rdzvd first (scripts/wheel)")
            stripped = os.path.join(tmp, tool)
            subprocess.run(["strip", "--strip-all", "-o", stripped, path], check=True)
            problems += check_elf(stripped)
            files.append((f"{data}/scripts/muster-{tool}", open(stripped, "rb").read(), True))
        if problems:
            raise SystemExit("muster_wheel: not manylinux_2_34:\n" + "\n".join(problems))
    standin = os.path.join(ROOT, "packaging", "muster-torchrun-standin")
    files.append((f"{data}/scripts/muster-torchrun-standin", open(standin, "rb").read(), True))
    py = os.path.join(ROOT, "python")
    for mod in ("muster_inplace.py", "muster_progress.py", "muster_progress_auto.py"):
        body = open(os.path.join(py, mod), "rb").read()
        files.append((mod, body, False))
        files.append((f"{data}/data/lib/muster/python/{mod}", body, False))
    files.append((f"{data}/data/lib/muster/python/muster_hook/sitecustomize.py",
                  open(os.path.join(py, "muster_hook", "sitecustomize.py"), "rb").read(), False))
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    metadata = (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {ver}\n"
                "Summary: A launcher for distributed training jobs (a drop-in for torchrun), "
                "its rendezvous daemon, and the PyTorch helpers\n"
                "Requires-Python: >=3.8\nDescription-Content-Type: text/markdown\n\n" + readme)
    files.append((f"{info}/METADATA", metadata.encode(), False))
    files.append((f"{info}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: muster_wheel\n"
                                    f"Root-Is-Purelib: false\nTag: {TAG}\n").encode(), False))
    files.append((f"{info}/top_level.txt", b"muster_inplace\nmuster_progress\nmuster_progress_auto\n", False))
    record = "".join(f"{n},{_hash(b)},{len(b)}\n" for n, b, _ in files) + f"{info}/RECORD,,\n"
    files.append((f"{info}/RECORD", record.encode(), False))

    wheel = f"{NAME}-{ver}-{TAG}.whl"
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, wheel)
    with zipfile.ZipFile(target + ".part", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, body, executable in files:
            zi = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            zi.external_attr = (0o100755 if executable else 0o100644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, body)
    os.replace(target + ".part", target)
    return wheel


# PEP 517: the build tree is MUSTER_BUILD_DIR, else build/ (scripts/wheel builds it first).
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    build_dir = os.environ.get("MUSTER_BUILD_DIR", os.path.join(ROOT, "build"))
    return make_wheel(build_dir, wheel_directory)


def get_requires_for_build_wheel(config_settings=None):
    return []


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: muster_wheel.py BUILD_DIR OUT_DIR")
    print(os.path.join(os.path.abspath(sys.argv[2]), make_wheel(sys.argv[1], sys.argv[2])))
