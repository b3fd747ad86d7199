#include "muster/agent/process.h"

#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace muster::agent {
namespace {

void write_str(int fd, const char* s) {
  ssize_t unused = ::write(fd, s, std::strlen(s));
  (void)unused;
}

}  // namespace

absl::StatusOr<ChildProcess> spawn_worker(const SpawnRequest& req) {
  std::vector<char*> argv, envp;
  for (const auto& a : req.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : req.envp) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe2");
  if (::pipe2(err, O_CLOEXEC) != 0) {
    int e = errno;
    ::close(out[0]);
    ::close(out[1]);
    return absl::ErrnoToStatus(e, "pipe2");
  }
  int in[2] = {-1, -1};  // the child's stdin, when it is not launch's own
  if (req.stdin_mode == SpawnRequest::Stdin::kPipe) {
    if (::pipe2(in, O_CLOEXEC) != 0) in[0] = in[1] = -1;
  } else if (req.stdin_mode == SpawnRequest::Stdin::kNull) {
    in[0] = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  if (req.stdin_mode != SpawnRequest::Stdin::kInherit && in[0] < 0) {
    int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
    return absl::ErrnoToStatus(e, "stdin");
  }
  // Masks for the binding, built before the fork (the child may only use them).
  // (Planned CPUs come from launch's own affinity, a cpu_set_t: each is below CPU_SETSIZE.)
  cpu_set_t cpu_set;
  CPU_ZERO(&cpu_set);
  for (int c : req.cpus) CPU_SET(c, &cpu_set);
  std::vector<unsigned long> node_mask(
      req.memory_node >= 0 ? static_cast<std::size_t>(req.memory_node) / 64 + 1 : 0, 0UL);
  if (req.memory_node >= 0) node_mask[req.memory_node / 64] |= 1UL << (req.memory_node % 64);
  const pid_t parent = ::getpid();
  const int cgroup_procs_fd = req.cgroup_procs_fd;
  // Signals stay blocked from before the fork until the child has put every handler back to
  // default: a signal sent to a child that has not exec'd yet must not run the agent's
  // handlers there (asio's would write into the agent's own self-pipe).
  sigset_t all, saved;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &saved);
  const pid_t pid = ::fork();
  if (pid != 0) ::pthread_sigmask(SIG_SETMASK, &saved, nullptr);
  if (pid < 0) {
    int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1], in[0], in[1]}) {
      if (fd >= 0) ::close(fd);
    }
    return absl::ErrnoToStatus(e, "fork");
  }
  if (pid == 0) {
    // Child: async-signal-safe calls only.
    for (int sig = 1; sig < NSIG; ++sig) {
      struct sigaction sa;
      if (::sigaction(sig, nullptr, &sa) == 0 && sa.sa_handler != SIG_DFL &&
          (sa.sa_handler != SIG_IGN || sig == SIGPIPE)) {
        ::signal(sig, SIG_DFL);
      }
    }
    ::setpgid(0, 0);
    if (cgroup_procs_fd >= 0) {
      // "0" moves the writer. A failed move leaves the worker to the process-group fallback.
      ssize_t unused = ::write(cgroup_procs_fd, "0", 1);
      (void)unused;
    }
    if (!req.cpus.empty() && ::sched_setaffinity(0, sizeof cpu_set, &cpu_set) != 0) {
      write_str(err[1], "launch: --numa_binding: cannot bind the worker to its CPUs: ");
      write_str(err[1], strerror(errno));
      write_str(err[1], "\n");
      ::_exit(127);
    }
    if (!node_mask.empty()) {
      // Best effort: a container may refuse it (EPERM without CAP_SYS_NICE under some
      // seccomp profiles); the CPU binding stands either way.
      ::syscall(SYS_set_mempolicy, MPOL_PREFERRED, node_mask.data(), node_mask.size() * 64 + 1);
    }
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the agent died before prctl took effect
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    if (in[0] >= 0) ::dup2(in[0], STDIN_FILENO);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(req.path.c_str(), argv.data(), envp.data());
    write_str(STDERR_FILENO, "launch: cannot execute ");
    write_str(STDERR_FILENO, req.path.c_str());
    write_str(STDERR_FILENO, ": ");
    write_str(STDERR_FILENO, strerror(errno));
    write_str(STDERR_FILENO, "\n");
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also in the parent, so signalling the group never races the child
  ::close(out[1]);
  ::close(err[1]);
  if (in[0] >= 0) ::close(in[0]);
  ChildProcess child;
  child.pid = pid;
  child.out_fd = out[0];
  child.err_fd = err[0];
  child.in_fd = in[1];
  child.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (child.pidfd < 0) {
    int e = errno;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ::close(child.out_fd);
    ::close(child.err_fd);
    if (child.in_fd >= 0) ::close(child.in_fd);
    return absl::ErrnoToStatus(e, "pidfd_open (Linux 5.3 or later is required)");
  }
  ::fcntl(child.pidfd, F_SETFD, FD_CLOEXEC);
  return child;
}

}  // namespace muster::agent
