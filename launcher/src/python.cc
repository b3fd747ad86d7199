#include "muster/launcher/python.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "muster/launcher/config.h"

extern char** environ;

namespace muster::launcher {
namespace {

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) != nullptr ? std::string(buf) : p;
}

// `import a, torch.x as t` or `from torch.nn import x`: does this statement name torch?
bool names_torch(absl::string_view line) {
  line = absl::StripLeadingAsciiWhitespace(line);
  auto is_torch = [](absl::string_view mod) {
    mod = absl::StripAsciiWhitespace(mod);
    return mod == "torch" || absl::StartsWith(mod, "torch.") || absl::StartsWith(mod, "torch ");
  };
  if (absl::ConsumePrefix(&line, "from ")) return is_torch(line);
  if (!absl::ConsumePrefix(&line, "import ")) return false;
  for (absl::string_view part : absl::StrSplit(line, ',')) {
    if (is_torch(part)) return true;
  }
  return false;
}

}  // namespace

bool can_import_torch(const std::string& interpreter, std::chrono::milliseconds timeout) {
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  for (int fd = 0; fd <= 2; ++fd) {
    ::posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", fd == 0 ? O_RDONLY : O_WRONLY,
                                       0);
  }
  std::vector<std::string> args = {
      interpreter, "-c",
      "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 1)"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, interpreter.c_str(), &actions, nullptr, argv.data(), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return false;
  // Wait on a pidfd (readable once the child exits): bounded, no sleep-polling.
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  bool exited = false;
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      const int n = ::poll(&p, 1, static_cast<int>(left.count()));
      if (n > 0) {
        exited = true;
        break;
      }
      if (n < 0 && errno != EINTR) break;
    }
    ::close(pidfd);
  }
  if (!exited) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return exited && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool script_imports_torch(const std::string& path) {
  std::ifstream in(path);
  if (!in) return false;
  constexpr std::size_t kMaxScan = 1 << 20;
  std::size_t seen = 0;
  std::string line;
  while (seen < kMaxScan && std::getline(in, line)) {
    seen += line.size() + 1;
    // One physical line may hold several statements: `import os; import torch`.
    for (absl::string_view stmt : absl::StrSplit(line, ';')) {
      if (names_torch(stmt)) return true;
    }
  }
  return false;
}

std::string module_source(const std::string& module, const std::string& dir) {
  const std::string base = absl::StrCat(dir, "/", absl::StrReplaceAll(module, {{".", "/"}}));
  for (const std::string& p : {base + ".py", base + "/__main__.py"}) {
    if (::access(p.c_str(), R_OK) == 0) return p;
  }
  return "";
}

absl::StatusOr<PythonChoice> choose_python(const std::map<std::string, std::string>& env,
                                           bool wants_torch, const TorchProbe& probe,
                                           std::chrono::milliseconds budget) {
  auto get = [&env](const char* k) {
    auto it = env.find(k);
    return it == env.end() ? std::string() : it->second;
  };
  const std::string path_var = get("PATH");
  auto fail = [](const absl::Status& s, absl::string_view what) {
    return absl::Status(s.code(), absl::StrCat("python interpreter (", what, "): ", s.message()));
  };
  if (const std::string exec = get("PYTHON_EXEC"); !exec.empty()) {
    auto exe = find_executable(exec, path_var);
    if (!exe.ok()) return fail(exe.status(), "PYTHON_EXEC");
    return PythonChoice{*exe, "PYTHON_EXEC"};
  }
  if (const std::string venv = get("VIRTUAL_ENV"); !venv.empty()) {
    const std::string p = venv + "/bin/python";
    if (is_executable_file(p)) return PythonChoice{p, "the active virtual environment, VIRTUAL_ENV"};
  }
  if (wants_torch) {
    const auto deadline = std::chrono::steady_clock::now() + budget;
    std::set<std::string> asked;
    for (absl::string_view dir : absl::StrSplit(path_var, ':')) {
      const std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/python3");
      if (!is_executable_file(candidate) || !asked.insert(real_path(candidate)).second) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      if (probe(candidate, left)) {
        return PythonChoice{candidate,
                            asked.size() == 1
                                ? "python3 from PATH, which can import torch"
                                : "the first python3 on PATH that can import torch"};
      }
    }
  }
  auto exe = find_executable("python3", path_var);
  if (!exe.ok()) return fail(exe.status(), "python3 from PATH");
  return PythonChoice{*exe, wants_torch ? "python3 from PATH (no python3 on PATH could import "
                                          "torch)"
                                        : "python3 from PATH"};
}

std::string muster_python_dir(const std::string& exe) {
  const auto holds_helpers = [](const std::string& dir) {
    return ::access((dir + "/muster_hook/sitecustomize.py").c_str(), R_OK) == 0 &&
           ::access((dir + "/muster_progress_auto.py").c_str(), R_OK) == 0;
  };
  if (auto slash = exe.rfind('/'); slash != std::string::npos) {
    std::string installed = exe.substr(0, slash) + "/../lib/muster/python";
    if (holds_helpers(installed)) return installed;
  }
  const std::string source = MUSTER_SOURCE_PYTHON_DIR;
  return holds_helpers(source) ? source : std::string();
}

std::string progress_hook_pythonpath(const std::string& exe) {
  const std::string dir = muster_python_dir(exe);
  return dir.empty() ? std::string() : absl::StrCat(dir, "/muster_hook:", dir);
}

}  // namespace muster::launcher
