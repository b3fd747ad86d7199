#include "health_check.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "muster/agent/process.h"

namespace muster::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// Copies complete lines of `buf` to stderr with the prefix; keeps the last one seen.
void flush_lines(std::string& buf, std::string& last, bool all) {
  std::size_t start = 0;
  for (std::size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1) {
    const std::string line = buf.substr(start, nl - start);
    std::fprintf(stderr, "[health_check] %s\n", line.c_str());
    if (!line.empty()) last = line;
  }
  buf.erase(0, start);
  if (all && !buf.empty()) {
    std::fprintf(stderr, "[health_check] %s\n", buf.c_str());
    last = buf;
    buf.clear();
  }
}

}  // namespace

absl::Status run_health_check(const HealthCheck& check,
                              const std::map<std::string, std::string>& env) {
  if (check.command.empty()) return absl::OkStatus();
  const auto t0 = Clock::now();
  agent::SpawnRequest req;
  req.path = "/bin/sh";
  req.argv = {"/bin/sh", "-c", check.command};
  for (const auto& [k, v] : env) req.envp.push_back(k + "=" + v);
  req.envp.push_back("MUSTER_HEALTH_CHECK=1");
  req.stdin_mode = agent::SpawnRequest::Stdin::kNull;
  const std::string what = absl::StrCat("health check failed on ", check.host, ": '",
                                        check.command, "'");
  auto child = agent::spawn_worker(req);
  if (!child.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(what, " could not start: ",
                                                      child.status().message()));
  }
  std::string out, err, last;
  int open = 2;
  bool timed_out = false;
  const auto deadline = t0 + check.timeout;
  while (open > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd fds[2] = {{child->out_fd, POLLIN, 0}, {child->err_fd, POLLIN, 0}};
    const int n = ::poll(fds, 2, static_cast<int>(std::min<long long>(left, 1000)));
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t r = ::read(fds[i].fd, buf, sizeof buf);
      std::string& b = i == 0 ? out : err;
      if (r > 0) {
        b.append(buf, static_cast<std::size_t>(r));
        flush_lines(b, last, false);
      } else if (r == 0 || errno != EINTR) {
        flush_lines(b, last, true);
        ::close(i == 0 ? child->out_fd : child->err_fd);
        (i == 0 ? child->out_fd : child->err_fd) = -1;
        --open;
      }
    }
  }
  if (timed_out) ::kill(-child->pid, SIGKILL);  // its own group: what it started too
  int status = 0;
  // Output closed (or the time is up): it has exited or is being killed; the rest of the
  // group's time is its own business, the check's process is reaped here.
  if (!timed_out) {
    pollfd pf{child->pidfd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (::poll(&pf, 1, static_cast<int>(std::max<long long>(0, left.count()))) == 0) {
      timed_out = true;
      ::kill(-child->pid, SIGKILL);
    }
  }
  ::waitpid(child->pid, &status, 0);
  for (int fd : {child->out_fd, child->err_fd, child->pidfd}) {
    if (fd >= 0) ::close(fd);
  }
  std::fflush(stderr);
  const std::string tail = last.empty() ? "" : absl::StrCat(" (its last line: ", last, ")");
  if (timed_out) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " did not finish within ", check.timeout.count() / 1000.0, " s", tail));
  }
  if (WIFSIGNALED(status)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " was killed by signal ", WTERMSIG(status), tail));
  }
  if (WEXITSTATUS(status) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " exited with ", WEXITSTATUS(status), tail));
  }
  return absl::OkStatus();
}

}  // namespace muster::launcher
