// hostnet: network-namespace "hosts" (tests/support/hostnet.h) for scripts and benchmarks.
// Needs root. Addresses are in 198.18.0.0/15, no host has a default route: nothing leaves the
// machine.
//
//   hostnet run N [--] CMD [ARGS...]
//       Makes N hosts, runs CMD in the root namespace with
//         HOSTNET_N          N
//         HOSTNET_GATEWAY    the bridge's address (the root namespace, reachable from every host)
//         HOSTNET_ADDR_<i>   host i's address          HOSTNET_HOST_<i>  its hostname, node<i>
//         HOSTNET_NS_<i>     its namespace's name      HOSTNET_CTL       this binary's path
//         HOSTNET_WRAP_<i>   a prefix (no quoting needed) that runs a command in host i:
//                            `$HOSTNET_WRAP_0 cmd args &` -- $! is cmd's own pid (all layers exec)
//       and when CMD exits (or hostnet gets SIGINT/SIGTERM/SIGHUP: CMD gets SIGTERM, then
//       SIGKILL after 5 s) kills every process left in the hosts (by pid), removes the hosts and
//       exits with CMD's status (128+N for a signal).
//   hostnet exec NS [--] CMD [ARGS...]   exec CMD in host NS (what HOSTNET_WRAP_<i> does)
//   hostnet cut NS | heal NS             silent partition of a host (iptables DROP in NS)
//   hostnet cut-between NS ADDR | heal-between NS ADDR   only the traffic between NS and ADDR
//   hostnet rate NS KBIT | unrate NS     tbf on both directions of the host's link
//
// A benchmark:
//   hostnet run 3 -- bash -c '
//     $HOSTNET_WRAP_0 rdzvd --host $HOSTNET_ADDR_0 ... & r=$!
//     $HOSTNET_WRAP_1 launch ... & a=$!
//     $HOSTNET_CTL cut $HOSTNET_NS_1; ...; $HOSTNET_CTL heal $HOSTNET_NS_1
//     kill $a $r; wait'
// Exit codes: CMD's status for run; 0 for the others, 1 on failure, 2 on a usage error.
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "hostnet.h"
#include "proc.h"

using muster::testing::HostNet;

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: hostnet run N [--] CMD [ARGS...]\n"
               "       hostnet exec NS [--] CMD [ARGS...]\n"
               "       hostnet cut|heal NS\n"
               "       hostnet cut-between|heal-between NS ADDR\n"
               "       hostnet rate NS KBIT | hostnet unrate NS\n");
  return 2;
}

int report(const absl::Status& s) {
  if (s.ok()) return 0;
  std::fprintf(stderr, "hostnet: %s\n", std::string(s.message()).c_str());
  return 1;
}

std::string self_path() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "hostnet";
}

std::vector<std::string> rest(int argc, char** argv, int from) {
  if (from < argc && std::string(argv[from]) == "--") ++from;
  return std::vector<std::string>(argv + from, argv + argc);
}

[[noreturn]] void exec_or_die(const std::vector<std::string>& v) {
  std::vector<char*> c;
  for (const auto& a : v) c.push_back(const_cast<char*>(a.c_str()));
  c.push_back(nullptr);
  ::execvp(c[0], c.data());
  std::perror(("hostnet: exec " + v[0]).c_str());
  ::_exit(127);
}

int waited_status(int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st); }

// Ends what CMD left in the hosts: SIGKILL by pid, then waits (bounded) for each to go.
void kill_leftovers(const HostNet& net) {
  std::vector<int> pidfds;
  for (int i = 0; i < net.size(); ++i) {
    for (pid_t p : muster::testing::ns_pids(net.ns(i))) {
      if (p == ::getpid()) continue;
      pidfds.push_back(muster::testing::open_pidfd(p));
      ::kill(p, SIGKILL);
    }
  }
  for (int fd : pidfds) {
    muster::testing::wait_pidfd(fd, std::chrono::seconds(5));
    if (fd >= 0) ::close(fd);
  }
}

int cmd_run(int n, const std::vector<std::string>& cmd) {
  // Signals are taken before the hosts exist, so none can end us between creation and cleanup.
  sigset_t set, old;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, s);
  sigprocmask(SIG_BLOCK, &set, &old);
  int sig_fd = ::signalfd(-1, &set, SFD_CLOEXEC);

  auto net = HostNet::create(n);
  if (!net.ok()) return report(net.status());
  std::string self = self_path();

  pid_t child = ::fork();
  if (child == 0) {
    sigprocmask(SIG_SETMASK, &old, nullptr);
    ::setenv("HOSTNET_N", std::to_string(n).c_str(), 1);
    ::setenv("HOSTNET_GATEWAY", (*net)->gateway().c_str(), 1);
    ::setenv("HOSTNET_CTL", self.c_str(), 1);
    for (int i = 0; i < n; ++i) {
      std::string k = std::to_string(i);
      ::setenv(("HOSTNET_ADDR_" + k).c_str(), (*net)->addr(i).c_str(), 1);
      ::setenv(("HOSTNET_HOST_" + k).c_str(), (*net)->hostname(i).c_str(), 1);
      ::setenv(("HOSTNET_NS_" + k).c_str(), (*net)->ns(i).c_str(), 1);
      ::setenv(("HOSTNET_WRAP_" + k).c_str(), (self + " exec " + (*net)->ns(i) + " --").c_str(), 1);
    }
    exec_or_die(cmd);
  }
  if (child < 0) return report(absl::InternalError("fork failed"));
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, child, 0));

  int status = -1;
  bool signalled = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (status < 0) {
    pollfd fds[2] = {{pidfd, POLLIN, 0}, {sig_fd, POLLIN, 0}};
    int timeout = -1;
    if (signalled) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      timeout = static_cast<int>(std::max<long>(0, left.count()));
    }
    int r = ::poll(fds, 2, timeout);
    if (r == 0 && signalled) {
      ::kill(child, SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
      signalled = false;  // now only the exit is awaited
      continue;
    }
    if (r > 0 && (fds[1].revents & POLLIN)) {
      signalfd_siginfo si;
      if (::read(sig_fd, &si, sizeof si) == sizeof si && !signalled) {
        ::kill(child, SIGTERM);
        signalled = true;
        deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      }
    }
    int st = 0;
    if (::waitpid(child, &st, WNOHANG) == child) status = waited_status(st);
  }
  ::close(pidfd);
  kill_leftovers(**net);
  net->reset();  // removes the hosts
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  std::string sub = argv[1];
  std::string arg = argv[2];
  if (sub == "run") {
    int n = std::atoi(arg.c_str());
    auto cmd = rest(argc, argv, 3);
    if (n < 1 || cmd.empty()) return usage();
    return cmd_run(n, cmd);
  }
  if (sub == "exec") {
    auto cmd = rest(argc, argv, 3);
    if (cmd.empty()) return usage();
    std::ifstream in("/etc/netns/" + arg + "/hostname");
    std::string host;
    std::getline(in, host);
    if (host.empty()) host = arg;
    exec_or_die(muster::testing::wrap_ns(arg, host, cmd));
  }
  if (sub == "cut" && argc == 3) return report(muster::testing::cut_ns(arg));
  if (sub == "heal" && argc == 3) return report(muster::testing::heal_ns(arg));
  if (sub == "cut-between" && argc == 4)
    return report(muster::testing::cut_between_ns(arg, argv[3]));
  if (sub == "heal-between" && argc == 4)
    return report(muster::testing::heal_between_ns(arg, argv[3]));
  if (sub == "rate" && argc == 4)
    return report(muster::testing::rate_limit_ns(arg, std::atoi(argv[3])));
  if (sub == "unrate" && argc == 3) return report(muster::testing::clear_limits_ns(arg));
  return usage();
}
