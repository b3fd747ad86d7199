// The worker program of the integration tests; argv[1] picks what it does.
//   env DIR              write the environment to DIR/env.<RANK>, exit 0
//   numa DIR             write Cpus_allowed_list and Mems_allowed_list (from /proc/self/status)
//                        and "mempolicy=<mode>:<nodes>" (get_mempolicy) to DIR/numa.<RANK>
//   exit CODE RANK       rank RANK exits with CODE at once; the others wait to be stopped
//   restart DIR UNTIL    append TORCHELASTIC_RESTART_COUNT to DIR/restarts.<RANK>; while the
//                        count is below UNTIL rank 0 exits 3 and the others wait to be stopped
//   restart DIR UNTIL wait   the same, but from UNTIL on every rank prints "ready <pid> ..."
//                        and waits to be stopped (instead of exiting 0)
//   term DIR handle      print "ready <pid>"; on SIGTERM write DIR/term.<RANK> and exit 0
//   term DIR ignore      print "ready <pid>"; ignore SIGTERM (only SIGKILL ends it)
//   wait                 print "ready <pid>" and wait to be stopped
//   signals DIR          append "<pid> <restart count>" to DIR/starts.<RANK> (its start record),
//                        print "ready <pid>", then exit 0 on SIGUSR1 and 3 on SIGUSR2
//   spew BYTES           write BYTES of numbered lines to stdout, exit 0
//   partial              write a line without its newline, then die by SIGKILL
//   errfile MESSAGE      write torch's @record error file with MESSAGE, exit 1
//   bigerr BYTES RANK    rank RANK writes an @record error file of BYTES whose message is
//                        "BigError: " and x's, and exits 1; the others wait to be stopped
//   die CODE             exit with CODE at once
//   burn SECONDS         print "ready <pid>", keep one core busy for SECONDS, exit 0
//   family child         start a child that waits forever, print "ready <pid>" and
//                        "family <child>", then wait to be stopped
//   family setsid        the same, and the child starts a grandchild that calls setsid()
//                        (its own session and process group): "family <child> <grandchild>"
#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

extern char** environ;

namespace {

std::string env(const char* k) {
  const char* v = std::getenv(k);
  return v != nullptr ? v : "";
}
int rank() { return std::atoi(env("RANK").c_str()); }

volatile sig_atomic_t got_term = 0;
void on_term(int) { got_term = 1; }
volatile sig_atomic_t got_usr = 0;
void on_usr(int sig) { got_usr = sig; }

[[noreturn]] void wait_forever() {
  for (;;) ::pause();
}

void ready() {
  std::printf("ready %d world %s round %s restart %s\n", static_cast<int>(::getpid()),
              env("WORLD_SIZE").c_str(), env("MUSTER_ROUND").c_str(),
              env("TORCHELASTIC_RESTART_COUNT").c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  const std::string mode = argv[1];
  if (mode == "env" && argc == 3) {
    std::ofstream out(std::string(argv[2]) + "/env." + env("RANK"));
    for (char** e = environ; *e != nullptr; ++e) out << *e << "\n";
    return 0;
  }
  if (mode == "numa" && argc == 3) {
    std::ofstream out(std::string(argv[2]) + "/numa." + env("RANK"));
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      for (const char* key : {"Cpus_allowed_list:", "Mems_allowed_list:"}) {
        if (line.rfind(key, 0) != 0) continue;
        std::string value = line.substr(std::strlen(key));
        value.erase(0, value.find_first_not_of(" \t"));
        out << std::string(key, std::strlen(key) - 1) << "=" << value << "\n";
      }
    }
    int policy = -1;
    unsigned long nodes[16] = {};
    std::string text = "unknown";
    if (::syscall(SYS_get_mempolicy, &policy, nodes, sizeof nodes * 8, nullptr, 0) == 0) {
      text = policy == MPOL_DEFAULT     ? "default"
             : policy == MPOL_PREFERRED ? "preferred"
             : policy == MPOL_BIND      ? "bind"
                                        : "other";
      std::string list;
      for (int n = 0; n < static_cast<int>(sizeof nodes * 8); ++n) {
        if ((nodes[n / 64] >> (n % 64)) & 1UL) list += (list.empty() ? "" : ",") + std::to_string(n);
      }
      text += ":" + list;
    }
    out << "mempolicy=" << text << "\n";
    return 0;
  }
  if (mode == "exit" && argc == 4) {
    if (rank() == std::atoi(argv[3])) {
      std::printf("rank %d exiting with %s\n", rank(), argv[2]);
      return std::atoi(argv[2]);
    }
    ready();
    wait_forever();
  }
  if (mode == "restart" && (argc == 4 || (argc == 5 && std::strcmp(argv[4], "wait") == 0))) {
    const int count = std::atoi(env("TORCHELASTIC_RESTART_COUNT").c_str());
    {
      std::ofstream out(std::string(argv[2]) + "/restarts." + env("RANK"), std::ios::app);
      out << count << "\n";
    }
    if (count >= std::atoi(argv[3])) {
      if (argc == 4) return 0;
      ready();
      wait_forever();
    }
    if (rank() == 0) return 3;
    ready();
    wait_forever();
  }
  if (mode == "term" && argc == 4) {
    if (std::strcmp(argv[3], "ignore") == 0) {
      ::signal(SIGTERM, SIG_IGN);
      ready();
      wait_forever();
    }
    struct sigaction sa {};
    sa.sa_handler = on_term;
    ::sigaction(SIGTERM, &sa, nullptr);
    ready();
    while (!got_term) ::pause();
    std::ofstream(std::string(argv[2]) + "/term." + env("RANK")) << "SIGTERM\n";
    return 0;
  }
  if (mode == "signals" && argc == 3) {
    struct sigaction sa {};
    sa.sa_handler = on_usr;
    ::sigaction(SIGUSR1, &sa, nullptr);
    ::sigaction(SIGUSR2, &sa, nullptr);
    sigset_t block, old;  // blocked until sigsuspend: a signal sent after "ready" is never lost
    ::sigemptyset(&block);
    ::sigaddset(&block, SIGUSR1);
    ::sigaddset(&block, SIGUSR2);
    ::sigprocmask(SIG_BLOCK, &block, &old);
    {
      std::ofstream out(std::string(argv[2]) + "/starts." + env("RANK"), std::ios::app);
      out << ::getpid() << " " << env("TORCHELASTIC_RESTART_COUNT") << "\n";
    }
    ready();
    while (got_usr == 0) ::sigsuspend(&old);
    return got_usr == SIGUSR1 ? 0 : 3;
  }
  if (mode == "wait") {
    ready();
    wait_forever();
  }
  if (mode == "spew" && argc == 3) {
    const long total = std::atol(argv[2]);
    std::string payload(80, 'x');
    long written = 0;
    std::string buf;
    for (long i = 0; written < total; ++i) {
      std::string line = "R" + env("RANK") + " L" + std::to_string(i) + " " + payload + "\n";
      written += static_cast<long>(line.size());
      buf += line;
      if (buf.size() > 4000) {  // odd-sized writes, so lines straddle pipe reads
        std::fwrite(buf.data(), 1, buf.size(), stdout);
        buf.clear();
      }
    }
    std::fwrite(buf.data(), 1, buf.size(), stdout);
    return 0;
  }
  if (mode == "partial") {
    const char msg[] = "no newline at the end";
    ssize_t n = ::write(1, msg, sizeof msg - 1);
    (void)n;
    ::kill(::getpid(), SIGKILL);
  }
  if (mode == "errfile" && argc == 3) {
    std::ofstream out(env("TORCHELASTIC_ERROR_FILE"));
    out << R"({"message": {"message": ")" << argv[2]
        << R"(", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"train.py\", line 1\n)"
        << argv[2] << R"(\n", "timestamp": "1700000000"}}})";
    out.close();
    return 1;
  }
  if (mode == "bigerr" && argc == 4) {
    if (rank() != std::atoi(argv[3])) {
      ready();
      wait_forever();
    }
    const long total = std::atol(argv[2]);
    std::ofstream out(env("TORCHELASTIC_ERROR_FILE"));
    const std::string head = R"({"message": {"message": "BigError: )";
    const std::string tail =
        R"(", "extraInfo": {"py_callstack": "Traceback\nBigError\n", "timestamp": "1"}}})";
    out << head << std::string(static_cast<std::size_t>(std::max(0L, total - static_cast<long>(head.size() + tail.size()))), 'x') << tail;
    out.close();
    return 1;
  }
  if (mode == "die" && argc == 3) return std::atoi(argv[2]);
  if (mode == "burn" && argc == 3) {
    ready();
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(std::atoi(argv[2]));
    volatile std::uint64_t x = 0;
    while (std::chrono::steady_clock::now() < end) {
      for (int i = 0; i < 1000000; ++i) x = x + static_cast<std::uint64_t>(i);
    }
    return 0;
  }
  if (mode == "family" && argc == 3) {
    const bool setsid = std::strcmp(argv[2], "setsid") == 0;
    int p[2];
    if (::pipe(p) != 0) return 70;
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(p[0]);
      pid_t grandchild = 0;
      if (setsid) {
        grandchild = ::fork();
        if (grandchild == 0) {
          ::setsid();  // leaves the worker's process group and session
          ::close(p[1]);
          wait_forever();
        }
      }
      ssize_t n = ::write(p[1], &grandchild, sizeof grandchild);
      (void)n;
      ::close(p[1]);
      wait_forever();
    }
    ::close(p[1]);
    pid_t grandchild = 0;
    ssize_t n = ::read(p[0], &grandchild, sizeof grandchild);
    (void)n;
    ::close(p[0]);
    ready();
    if (setsid) {
      std::printf("family %d %d\n", static_cast<int>(child), static_cast<int>(grandchild));
    } else {
      std::printf("family %d\n", static_cast<int>(child));
    }
    std::fflush(stdout);
    wait_forever();
  }
  std::fprintf(stderr, "test_worker: bad arguments\n");
  return 64;
}
