"""Progress reports for an unmodified PyTorch script, for launch's --hang_timeout.

launch puts python/muster_hook (a sitecustomize) on a Python worker's PYTHONPATH when the run
has a hang timeout; it calls install() at interpreter start. No torch is imported here: once
the script imports torch's DDP and optimizer modules, their classes are wrapped so that every
training step reports through muster_progress (docs/hangs.md, "Unmodified PyTorch scripts"):

    DistributedDataParallel.forward starts   step(n, "forward")     n: optimizer steps so far
    DistributedDataParallel.forward returns  phase("backward")      loss.backward, all-reduce
    Optimizer.step starts                    step(n, "optimizer")
    Optimizer.step returns                   step(n + 1, "between_steps")  data loading, ...

So a rank stuck loading the data of step n is one report behind the ranks already inside
step n's forward or backward, and is named "at step n in phase 'between_steps'". What it cannot see: a
loop without DDP or without a torch optimizer, and work that only some ranks do through a DDP
module (those ranks then look ahead). A script that calls muster_progress itself turns these
reports off from its first call. MUSTER_PROGRESS_AUTO=0 turns them off. A failure here never
fails the script: the hook then stays off with one line on stderr.
"""

import functools
import importlib.abc
import os
import sys

import muster_progress

__all__ = ["install"]

_steps = 0  # optimizer steps taken, all optimizers together


def _report(phase):
    if not muster_progress.explicit:
        muster_progress._step(_steps, phase)


def _set_phase(name):
    if not muster_progress.explicit:
        muster_progress._phase(name)


def _before_step():
    _report("optimizer")


def _after_step():
    global _steps
    _steps += 1
    _report("between_steps")


def _wrap_forward(forward):
    @functools.wraps(forward)
    def forward_reported(self, *args, **kwargs):
        _report("forward")
        out = forward(self, *args, **kwargs)
        _set_phase("backward")
        return out

    forward_reported._muster_progress = True
    return forward_reported


def _wrap_step(step):
    @functools.wraps(step)
    def step_reported(*args, **kwargs):
        _before_step()
        out = step(*args, **kwargs)
        _after_step()
        return out

    step_reported._muster_progress = True
    return step_reported


def _patch_ddp(module):
    ddp = module.DistributedDataParallel
    if not getattr(ddp.forward, "_muster_progress", False):
        ddp.forward = _wrap_forward(ddp.forward)


def _patch_optimizer(module):
    pre = getattr(module, "register_optimizer_step_pre_hook", None)
    post = getattr(module, "register_optimizer_step_post_hook", None)
    if pre is not None and post is not None:  # torch >= 2.0: global hooks
        pre(lambda opt, args, kwargs: _before_step())
        post(lambda opt, args, kwargs: _after_step())
        return
    # torch 1.x: each optimizer class's step, wrapped once, when its first instance is made.
    optimizer = module.Optimizer
    init = optimizer.__init__

    @functools.wraps(init)
    def init_then_wrap(self, *args, **kwargs):
        init(self, *args, **kwargs)
        cls = type(self)
        if not getattr(cls.step, "_muster_progress", False):
            cls.step = _wrap_step(cls.step)

    optimizer.__init__ = init_then_wrap


_PATCHES = {
    "torch.nn.parallel.distributed": _patch_ddp,
    "torch.optim.optimizer": _patch_optimizer,
}


def _off(why):
    sys.stderr.write("muster_progress_auto: automatic progress reports off: %s\n" % why)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules in _PATCHES it asks the finders after it, then
    runs the patch once the module has been executed."""

    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            try:
                patch(module)
            except Exception as e:  # never fail the script for its progress reports
                _off("%s: %s: %s" % (fullname, type(e).__name__, e))

        spec.loader.exec_module = exec_then_patch
        return spec


_installed = False


def install():
    """Arms the wrapping; does nothing without a progress page or with MUSTER_PROGRESS_AUTO=0."""
    global _installed
    if _installed or not os.environ.get(muster_progress._VAR):
        return
    if os.environ.get("MUSTER_PROGRESS_AUTO", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    _installed = True
    sys.meta_path.insert(0, _Finder())
