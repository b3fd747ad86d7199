#include "muster/agent/proc_state.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>

#include "absl/strings/str_cat.h"

namespace muster::agent {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

// Read in one go; nothing of ours is larger than 4 KiB (at most 64 KiB is kept).
std::optional<std::string> read_proc_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
    if (out.size() > 64 * 1024) break;
  }
  ::close(fd);
  return out;
}

std::optional<ProcState> parse_proc_state(std::string_view stat, std::string_view wchan) {
  // "812 (my (odd) prog) D 1 ...": digits, " (", the name, ") ", the state, a space or the end.
  const std::size_t open = stat.find(" (");
  const std::size_t close = stat.rfind(')');
  if (open == std::string_view::npos || open == 0 || close == std::string_view::npos ||
      close < open + 1) {
    return std::nullopt;
  }
  for (char c : stat.substr(0, open)) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  std::string_view rest = stat.substr(close + 1);
  if (rest.size() < 2 || rest[0] != ' ' || !std::isalpha(static_cast<unsigned char>(rest[1]))) {
    return std::nullopt;
  }
  if (rest.size() > 2 && !std::isspace(static_cast<unsigned char>(rest[2]))) return std::nullopt;
  ProcState s;
  s.state = rest[1];
  std::string_view w = trim(wchan);
  if (w != "0") s.wchan = std::string(w);
  return s;
}

std::optional<ProcState> read_proc_state(pid_t pid) {
  const std::string dir = absl::StrCat("/proc/", pid);
  std::optional<std::string> stat = read_proc_file(dir + "/stat");
  if (!stat) return std::nullopt;
  return parse_proc_state(*stat, read_proc_file(dir + "/wchan").value_or(""));
}

std::vector<std::size_t> workers_to_abandon(const std::vector<std::optional<ProcState>>& states) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < states.size(); ++i) {
    if (states[i] && states[i]->state == 'D') out.push_back(i);
  }
  return out;
}

std::string stuck_worker_message(int rank, pid_t pid, const ProcState& state,
                                 std::string_view kernel_stack, int max_stack_lines) {
  std::string out = absl::StrCat("worker rank ", rank, " (pid ", pid,
                                 ") is stuck in the kernel (state ", std::string(1, state.state));
  if (!state.wchan.empty()) absl::StrAppend(&out, ", wchan ", state.wchan);
  absl::StrAppend(&out, "): it does not die on SIGKILL; going on without it");
  int lines = 0;
  while (!kernel_stack.empty() && lines < max_stack_lines) {
    const std::size_t nl = kernel_stack.find('\n');
    std::string_view line = kernel_stack.substr(0, nl);
    kernel_stack.remove_prefix(nl == std::string_view::npos ? kernel_stack.size() : nl + 1);
    if (trim(line).empty()) continue;
    out.append("\n  ").append(line);
    ++lines;
  }
  return out;
}

}  // namespace muster::agent
