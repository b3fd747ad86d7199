"""Progress reports from a Python worker to its muster agent, for hang detection.

Usage, in the training loop::

    import muster_progress

    for step in range(steps):
        muster_progress.step(step, "forward")
        ...
        muster_progress.phase("all_reduce")
        ...

The agent that started this process names a progress page in MUSTER_PROGRESS_FILE (a 4096-byte
file it made); each call stores the step, the phase and the CLOCK_MONOTONIC time there, and the
agent reads it on a timer to tell a hung rank from a busy one (docs/hangs.md). The bytes are
those of write_progress in ops/include/muster/ops/progress_page.h, which defines
the layout. Without the variable (under torchrun, say) or when the page is not usable every
call is a no-op: a worker never fails for want of a page.

This module is a single file with no dependencies beyond the standard library: copy it next to
the training script, or add the folder that holds it to PYTHONPATH. The page is opened on the
first call and stays mapped; a call then costs a few stores into it and no system call. Call it
from one thread at a time (the page has one writer).
"""

import mmap
import os
import struct
import sys
import time

__all__ = ["step", "phase"]

_VAR = "MUSTER_PROGRESS_FILE"
_MAGIC = 0x3150504D  # "MPP1"
_VERSION = 1
_PAGE_BYTES = 4096
_PHASE_BYTES = 64

# Offsets (progress_page.h): magic u32 @0, version u32 @4, seq u64 @8, step u64 @16,
# time_ns u64 @24, reports u64 @32, phase char[64] @40, kind u32 @104, kind_since u64 @112,
# kind_ns u64[5] @120; little-endian.
_HEADER = struct.Struct("<II")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_REPORT = struct.Struct("<QQQ")  # step, time_ns, reports
_SEQ, _STEP, _REPORTS, _PHASE = 8, 16, 32, 40
_KIND, _KIND_SINCE, _KIND_NS = 104, 112, 120

# phase_kind of progress_page.h: what a phase stands for, by the start of its name, first
# match (docs/stragglers.md): 0 data, 1 compute, 2 collective wait, 3 optimizer, 4 other.
_KIND_RULES = (("data", 0), ("input", 0), ("load", 0),
               ("forward", 1), ("compute", 1),
               ("backward", 2), ("all_reduce", 2), ("allreduce", 2), ("reduce", 2),
               ("all_gather", 2), ("allgather", 2), ("broadcast", 2), ("barrier", 2),
               ("collective", 2), ("comm", 2), ("sync", 2), ("wait", 2),
               ("optim", 3))
_OTHER = 4
_kinds = {}  # phase name -> kind, as computed once


def _kind(name):
    k = _kinds.get(name)
    if k is None:
        k = next((kind for prefix, kind in _KIND_RULES if name.startswith(prefix)), _OTHER)
        if len(_kinds) < 256:
            _kinds[name] = k
    return k

_page = None  # the mmap, once opened
_opened = False  # True once an open was tried (a failed one is not retried)


def _open():
    global _page, _opened
    _opened = True
    path = os.environ.get(_VAR)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(fd).st_size < _PAGE_BYTES:
                raise ValueError("shorter than a progress page")
            page = mmap.mmap(fd, _PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file
        if _HEADER.unpack_from(page, 0) != (_MAGIC, _VERSION):
            page.close()
            raise ValueError("not a progress page of version %d" % _VERSION)
    except (OSError, ValueError) as e:
        sys.stderr.write("muster_progress: progress reports off: %s %s: %s\n" % (_VAR, path, e))
        return None
    _page = page
    return page


def _phase_bytes(name):
    b = name.encode("utf-8", "replace")[: _PHASE_BYTES - 1]
    return b + b"\0" * (_PHASE_BYTES - len(b))


def _write(page, fields, name, now):
    # The sequence lock of write_progress: seq odd while the fields change, even after.
    seq = _U64.unpack_from(page, _SEQ)[0] | 1
    _U64.pack_into(page, _SEQ, seq)
    if fields is not None:
        _REPORT.pack_into(page, _STEP, *fields)
    page[_PHASE:_PHASE + _PHASE_BYTES] = _phase_bytes(name)
    # store_kind: the phase that ends now adds to its kind's time; `name` begins.
    since = _U64.unpack_from(page, _KIND_SINCE)[0]
    kind = _U32.unpack_from(page, _KIND)[0]
    if since and now > since and kind <= _OTHER:
        at = _KIND_NS + 8 * kind
        _U64.pack_into(page, at, (_U64.unpack_from(page, at)[0] + now - since) % 2**64)
    _U32.pack_into(page, _KIND, _kind(name))
    _U64.pack_into(page, _KIND_SINCE, now)
    _U64.pack_into(page, _SEQ, seq + 1)


def step(n, phase=""):
    """Reports step `n` (a negative step is recorded as 0) and what the worker is doing
    (`phase`, cut to 63 bytes), with the time now."""
    global explicit
    explicit = True
    _step(n, phase)


def phase(name):
    """Changes only the phase of the last report (step, time and count stay)."""
    global explicit
    explicit = True
    _phase(name)


# True once the program called step() or phase() itself: launch's automatic reports for
# unmodified PyTorch scripts (muster_progress_auto) then stop, so the two never mix.
explicit = False


def _step(n, phase):
    page = _page if _opened else _open()
    if page is None:
        return
    reports = _U64.unpack_from(page, _REPORTS)[0] + 1
    now = time.monotonic_ns()
    _write(page, (min(max(0, int(n)), 2**64 - 1), now, reports), phase, now)


def _phase(name):
    page = _page if _opened else _open()
    if page is None:
        return
    _write(page, None, name, time.monotonic_ns())
