// The worker of the chaos test (tests/chaos/chaos.cc). It is started by `launch` and starts
// processes of its own, the way real training programs do (data loaders, helpers, daemons):
//
//   chaos_worker worker key=value...   the worker; keys (all optional):
//       mode=run|exit|fail   run: block until killed; exit: exit 0 after `delay` ms;
//                            fail: the rank `seed % WORLD_SIZE` exits 1 after `delay` ms while
//                            TORCHELASTIC_RESTART_COUNT < `fail_until`, every other worker (and
//                            that rank in later attempts) exits 0 after 2 x `delay` ms
//       delay=MS  seed=N  fail_until=K
//       kids=0..2            children that block (the second one ignores SIGTERM/SIGINT/SIGHUP
//                            when stubborn_kid=1)
//       setsid=0|1           a grandchild that leaves the worker's session and process group
//                            (double fork + setsid, parent 1), the way daemons do
//       stubborn=0|1         the worker itself ignores SIGTERM (only the agent's SIGKILL ends it)
//       store=0|1            the worker parks a store get on a key nobody sets (120 s timeout)
//       in_place=0|1         declares in-place support (launch --in_place) and answers every
//                            new world with `resumed` (docs/in_place.md)
//   chaos_worker child plain|stubborn   a child: blocks until killed
//   chaos_worker gchild                 the setsid grandchild: blocks until killed
//
// The worker prints "ready <pid> kids <pid>,<pid> gchild <pid>" once its processes exist.
// Every process inherits the environment, so the test finds all of them by its marker variable.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "muster/worker/runtime.h"

namespace {

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

[[noreturn]] void block_forever() {
  for (;;) ::pause();
}

void ignore_stop_signals() {
  ::signal(SIGTERM, SIG_IGN);
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGHUP, SIG_IGN);
}

[[noreturn]] void exec_self(const std::vector<std::string>& args) {
  static std::string exe = self_exe();
  std::vector<char*> argv{exe.data()};
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execv(exe.c_str(), argv.data());
  ::_exit(127);
}

pid_t start_child(const std::string& kind) {
  pid_t pid = ::fork();
  if (pid == 0) exec_self({"child", kind});
  return pid;
}

// Double fork: the middle process calls setsid, forks the grandchild, reports its pid on a
// pipe and exits, so the grandchild is in its own session and process group with parent 1.
pid_t start_setsid_grandchild() {
  int p[2];
  if (::pipe(p) != 0) return -1;
  pid_t mid = ::fork();
  if (mid == 0) {
    ::close(p[0]);
    ::setsid();
    pid_t g = ::fork();
    if (g == 0) {
      ::close(p[1]);
      exec_self({"gchild"});
    }
    (void)!::write(p[1], &g, sizeof g);
    ::_exit(0);
  }
  ::close(p[1]);
  pid_t g = -1;
  if (::read(p[0], &g, sizeof g) != sizeof g) g = -1;
  ::close(p[0]);
  ::waitpid(mid, nullptr, 0);
  return g;
}

int env_int(const char* k) {
  const char* v = std::getenv(k);
  return v != nullptr ? std::atoi(v) : 0;
}

[[noreturn]] void finish(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);  // no destructors: a store thread may still be parked
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  const std::string role = argv[1];
  if (role == "child") {
    if (argc > 2 && std::strcmp(argv[2], "stubborn") == 0) ignore_stop_signals();
    block_forever();
  }
  if (role == "gchild") block_forever();
  if (role != "worker") return 64;

  std::map<std::string, std::string> opt;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto eq = a.find('=');
    if (eq != std::string::npos) opt[a.substr(0, eq)] = a.substr(eq + 1);
  }
  auto num = [&](const char* k, long def) {
    auto it = opt.find(k);
    return it == opt.end() ? def : std::atol(it->second.c_str());
  };
  const std::string mode = opt.count("mode") ? opt["mode"] : "run";
  const long delay = num("delay", 500);

  if (num("stubborn", 0) != 0) ::signal(SIGTERM, SIG_IGN);

  // Processes first, before any thread (gRPC) exists in this process.
  std::vector<pid_t> kids;
  const long nkids = num("kids", 0);
  for (long i = 0; i < nkids; ++i) {
    kids.push_back(start_child(i == 1 && num("stubborn_kid", 0) != 0 ? "stubborn" : "plain"));
  }
  pid_t gchild = num("setsid", 0) != 0 ? start_setsid_grandchild() : -1;

  std::unique_ptr<muster::worker::Runtime> rt;
  const bool in_place = num("in_place", 0) != 0;
  if (num("store", 0) != 0 || in_place) {
    auto r = muster::worker::Runtime::from_env();
    if (r.ok()) rt = std::move(*r);
  }
  if (rt && num("store", 0) != 0) {
    std::thread([&rt] {
      (void)rt->store().get("chaos/never-set", std::chrono::seconds(120));
    }).detach();
  }
  if (rt && in_place && rt->enable_in_place().ok()) {
    // Nothing to re-form: every new world is answered at once.
    std::thread([&rt] {
      for (;;) {
        if (!rt->await_world(std::chrono::hours(1)).ok()) return;
        (void)rt->resumed();
      }
    }).detach();
  }

  std::string line = "ready " + std::to_string(::getpid()) + " kids ";
  for (std::size_t i = 0; i < kids.size(); ++i) {
    line += (i != 0 ? "," : "") + std::to_string(kids[i]);
  }
  line += " gchild " + std::to_string(gchild) + " restart " +
          std::to_string(env_int("TORCHELASTIC_RESTART_COUNT")) + "\n";
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);

  auto sleep_ms = [](long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); };
  if (mode == "exit") {
    sleep_ms(delay);
    finish(0);
  }
  if (mode == "fail") {
    const int world = std::max(1, env_int("WORLD_SIZE"));
    const bool failing = env_int("RANK") == static_cast<int>(num("seed", 0) % world) &&
                         env_int("TORCHELASTIC_RESTART_COUNT") < num("fail_until", 1);
    if (failing) {
      sleep_ms(delay);
      std::fprintf(stderr, "chaos_worker: failing on purpose\n");
      finish(1);
    }
    sleep_ms(2 * delay);
    finish(0);
  }
  block_forever();
}
