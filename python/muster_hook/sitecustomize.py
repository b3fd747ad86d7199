"""launch's hook for Python workers of a run with a hang timeout (docs/hangs.md): launch puts
this folder and python/ first on PYTHONPATH, so Python runs this at start-up. It arms
muster_progress_auto, then runs the sitecustomize this one shadows (Debian's, a virtual
environment's), as if this one were not there."""

import importlib.machinery
import importlib.util
import os
import sys


def _arm():
    try:
        import muster_progress_auto

        muster_progress_auto.install()
    except Exception as e:  # never fail the worker for its progress reports
        sys.stderr.write("muster_hook: automatic progress reports off: %s: %s\n"
                         % (type(e).__name__, e))


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_arm()
_chain()
