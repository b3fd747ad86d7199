#include "muster/agent/process.h"

#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muster::agent {
namespace {

void write_str(int fd, const char* s) {
  ssize_t unused = ::write(fd, s, std::strlen(s));
  (void)unused;
}

// The child's three standard streams: stdout and stderr to the agent, stdin as asked.
struct Pipes {
  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  int in[2] = {-1, -1};  // the child's stdin, when it is not launch's own
  void close_all() {
    for (int* p : {out, err, in}) {
      for (int i = 0; i < 2; ++i) {
        if (p[i] >= 0) ::close(p[i]);
        p[i] = -1;
      }
    }
  }
};

absl::Status open_pipes(const SpawnRequest& req, Pipes& p) {
  if (::pipe2(p.out, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe2");
  if (::pipe2(p.err, O_CLOEXEC) != 0) {
    const int e = errno;
    p.close_all();
    return absl::ErrnoToStatus(e, "pipe2");
  }
  if (req.stdin_mode == SpawnRequest::Stdin::kPipe) {
    if (::pipe2(p.in, O_CLOEXEC) != 0) p.in[0] = p.in[1] = -1;
  } else if (req.stdin_mode == SpawnRequest::Stdin::kNull) {
    p.in[0] = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  if (req.stdin_mode != SpawnRequest::Stdin::kInherit && p.in[0] < 0) {
    const int e = errno;
    p.close_all();
    return absl::ErrnoToStatus(e, "stdin");
  }
  return absl::OkStatus();
}

// What the child needs, made before the clone (the child may only read it).
struct ChildSetup {
  std::vector<char*> argv, envp;
  // (Planned CPUs come from launch's own affinity, a cpu_set_t: each is below CPU_SETSIZE.)
  cpu_set_t cpu_set;
  std::vector<unsigned long> node_mask;
  pid_t parent = -1;
};

ChildSetup child_setup(const SpawnRequest& req) {
  ChildSetup c;
  for (const auto& a : req.argv) c.argv.push_back(const_cast<char*>(a.c_str()));
  c.argv.push_back(nullptr);
  for (const auto& e : req.envp) c.envp.push_back(const_cast<char*>(e.c_str()));
  c.envp.push_back(nullptr);
  CPU_ZERO(&c.cpu_set);
  for (int cpu : req.cpus) CPU_SET(cpu, &c.cpu_set);
  if (req.memory_node >= 0) {
    c.node_mask.assign(static_cast<std::size_t>(req.memory_node) / 64 + 1, 0UL);
    c.node_mask[req.memory_node / 64] |= 1UL << (req.memory_node % 64);
  }
  c.parent = ::getpid();
  return c;
}

// The child, between clone and exec. It runs in the agent's memory (CLONE_VM) while the
// agent's thread waits (CLONE_VFORK), as posix_spawn's child does: async-signal-safe calls
// only, nothing written but its own stack (errno aside: the waiting thread's, which is not
// read after), no allocation, and messages without translation (strerrordesc_np).
[[noreturn]] void run_child(const SpawnRequest& req, const ChildSetup& c, const Pipes& p) {
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction sa;
    if (::sigaction(sig, nullptr, &sa) == 0 && sa.sa_handler != SIG_DFL &&
        (sa.sa_handler != SIG_IGN || sig == SIGPIPE)) {
      ::signal(sig, SIG_DFL);
    }
  }
  ::setpgid(0, 0);
  if (req.cgroup_procs_fd >= 0) {
    // "0" moves the writer. A failed move leaves the worker to the process-group fallback.
    ssize_t unused = ::write(req.cgroup_procs_fd, "0", 1);
    (void)unused;
  }
  if (!req.cpus.empty() && ::sched_setaffinity(0, sizeof c.cpu_set, &c.cpu_set) != 0) {
    write_str(p.err[1], "launch: --numa_binding: cannot bind the worker to its CPUs: ");
    write_str(p.err[1], strerrordesc_np(errno));
    write_str(p.err[1], "\n");
    ::_exit(127);
  }
  if (!c.node_mask.empty()) {
    // Best effort: a container may refuse it (EPERM without CAP_SYS_NICE under some seccomp
    // profiles); the CPU binding stands either way.
    ::syscall(SYS_set_mempolicy, MPOL_PREFERRED, c.node_mask.data(), c.node_mask.size() * 64 + 1);
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != c.parent) ::_exit(1);  // the agent died before prctl took effect
  ::dup2(p.out[1], STDOUT_FILENO);
  ::dup2(p.err[1], STDERR_FILENO);
  if (p.in[0] >= 0) ::dup2(p.in[0], STDIN_FILENO);
  if (req.control_fd >= 0) ::fcntl(req.control_fd, F_SETFD, 0);  // this one survives exec
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(req.path.c_str(), c.argv.data(), c.envp.data());
  write_str(STDERR_FILENO, "launch: cannot execute ");
  write_str(STDERR_FILENO, req.path.c_str());
  write_str(STDERR_FILENO, ": ");
  write_str(STDERR_FILENO, strerrordesc_np(errno));
  write_str(STDERR_FILENO, "\n");
  ::_exit(127);
}

struct ChildArgs {
  const SpawnRequest* req;
  const ChildSetup* setup;
  const Pipes* pipes;
};

int child_main(void* arg) {
  const auto* a = static_cast<const ChildArgs*>(arg);
  run_child(*a->req, *a->setup, *a->pipes);
}

// The child's stack while it shares the agent's memory: run_child's frames and the libc
// calls it makes. Mapped for each spawn (pages are touched only as used) and unmapped once
// the child has exec'd or exited: CLONE_VFORK returns only then.
constexpr std::size_t kChildStack = 64 * 1024;

// clone(CLONE_VM | CLONE_VFORK): no copy of the agent's page tables, no copy-on-write faults
// in either process afterwards (a fork of the agent, with its gRPC threads and heaps, cost
// each worker about 70 page faults before exec and the agent as many after: docs/launch.md,
// "What start-up costs"). Returns the child's pid, or -1 with errno.
pid_t clone_and_exec(const SpawnRequest& req, const ChildSetup& setup, const Pipes& pipes) {
  void* stack = ::mmap(nullptr, kChildStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) return -1;
  ChildArgs args{&req, &setup, &pipes};
  const pid_t pid = ::clone(child_main, static_cast<char*>(stack) + kChildStack,
                            CLONE_VM | CLONE_VFORK | SIGCHLD, &args);
  const int e = errno;
  ::munmap(stack, kChildStack);
  errno = e;
  return pid;
}

}  // namespace

absl::StatusOr<ChildProcess> spawn_worker(const SpawnRequest& req) {
  Pipes p;
  if (absl::Status s = open_pipes(req, p); !s.ok()) return s;
  const ChildSetup setup = child_setup(req);
  // Signals stay blocked from before the clone until the child has put every handler back to
  // default: a signal sent to a child that has not exec'd yet must not run the agent's
  // handlers there (asio's would write into the agent's own self-pipe, and the child runs in
  // the agent's memory).
  sigset_t all, saved;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &saved);
  const pid_t pid = clone_and_exec(req, setup, p);
  const int clone_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &saved, nullptr);
  if (pid < 0) {
    p.close_all();
    return absl::ErrnoToStatus(clone_errno, "clone");
  }
  ::setpgid(pid, pid);  // also in the parent, so signalling the group never races the child
  ::close(p.out[1]);
  ::close(p.err[1]);
  if (p.in[0] >= 0) ::close(p.in[0]);
  ChildProcess child;
  child.pid = pid;
  child.out_fd = p.out[0];
  child.err_fd = p.err[0];
  child.in_fd = p.in[1];
  child.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (child.pidfd < 0) {
    const int e = errno;
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
