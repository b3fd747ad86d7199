// Which Python interpreter runs a .py program or a -m module (docs/launch.md, "Entry point").
//
// torchrun runs workers under its own sys.executable, the interpreter that has torch. launch
// is not a Python program, so it picks the interpreter the user means, in this order:
//   1. $PYTHON_EXEC (torchrun's variable; a name is looked up on PATH),
//   2. $VIRTUAL_ENV/bin/python, the interpreter of an active virtual environment,
//   3. only when the program imports torch (a scan of its text): the first python3 on PATH
//      that can import torch (each asked once, all within a time budget),
//   4. python3 from PATH.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace muster::launcher {

struct PythonChoice {
  std::string path;    // the interpreter exec'd
  std::string reason;  // why it was chosen, for the log and the failure hint
};

// Asks `interpreter` whether it can import torch (finding the package, without importing it:
// `importlib.util.find_spec('torch')`, milliseconds instead of seconds); stdio on /dev/null.
// false when it says no, fails to start, or has not answered within `timeout` (it is then
// killed and reaped). Blocks the caller for at most `timeout`.
bool can_import_torch(const std::string& interpreter, std::chrono::milliseconds timeout);

using TorchProbe =
    std::function<bool(const std::string& interpreter, std::chrono::milliseconds timeout)>;

// Whether the Python source at `path` imports torch: a line starting (after indentation) with
// `import torch` or `from torch` (also `import torch.distributed as dist`, `import os, torch`).
// Reads at most 1 MiB; false when the file cannot be read. A cheap scan, not a parser.
bool script_imports_torch(const std::string& path);

// The source file of `-m module` below `dir`: module/path.py, else module/path/__main__.py;
// empty when neither exists (an installed module: not scanned).
std::string module_source(const std::string& module, const std::string& dir = ".");

// The order above. `wants_torch`: the program imports torch (step 3 applies). `probe` is
// asked about each distinct python3 on PATH (by real path) until one says yes or `budget`
// is spent. Fails (a usage error) when the chosen interpreter is missing or not executable:
// a PYTHON_EXEC that names nothing is never silently replaced.
absl::StatusOr<PythonChoice> choose_python(const std::map<std::string, std::string>& env,
                                           bool wants_torch, const TorchProbe& probe,
                                           std::chrono::milliseconds budget);

// The folder of muster's Python helpers (muster_progress.py, muster_progress_auto.py and
// muster_hook/): lib/muster/python beside an installed launch (`exe` is its path), else the
// source tree's python/ this launch was built from; empty when neither holds them.
std::string muster_python_dir(const std::string& exe);

// What goes first on a Python worker's PYTHONPATH when its run has a hang timeout, so that an
// unmodified PyTorch script reports its steps (docs/hangs.md): "DIR/muster_hook:DIR", DIR as
// above; empty without it.
std::string progress_hook_pythonpath(const std::string& exe);

// The probes' default time budget, all together.
inline constexpr std::chrono::milliseconds kTorchProbeBudget{5000};

}  // namespace muster::launcher
