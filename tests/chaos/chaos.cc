// The chaos test: randomized, seeded trials of real `launch` agents (standalone, several agents
// around a hosting agent, or around an `rdzvd`), workers that start children and a setsid
// grandchild, and random kill -9 / SIGTERM / SIGINT of launchers, rdzvd, workers and their
// children. After each trial:
//   HANG     every launch and rdzvd must have exited within a bound
//   EXIT     each exit code is 0, 1, or 128+N for a signal N sent to that process (or death
//            by a SIGKILL sent to it)
//   ORPHAN   no process carrying the trial's marker (MUSTER_CHAOS_TRIAL=<id> in its
//            environment, inherited by everything the trial starts) is alive; zombies count as
//            dead; a short settling time is allowed (waited for on pidfds, not slept)
//   TEMP     the trial's own TMPDIR is empty (launch's private muster_XXXXXX folders removed)
// Usage:
//   chaos [--seed S] [--trials N] [--trial K] [--launch PATH] [--rdzvd PATH] [--worker PATH]
//         [--hang_timeout SECONDS] [--verbose]
// Trial K of seed S always draws the same schedule (`chaos --seed S --trial K` repeats it;
// timing of the real processes still varies). The harness kills nothing without the marker
// except the processes it started itself, and ends every process of a trial before the next.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "proc.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

#ifndef LAUNCH_BIN
#define LAUNCH_BIN "launch"
#endif
#ifndef RDZVD_BIN
#define RDZVD_BIN "rdzvd"
#endif
#ifndef CHAOS_WORKER_BIN
#define CHAOS_WORKER_BIN "chaos_worker"
#endif

constexpr const char* kMarker = "MUSTER_CHAOS_TRIAL";

volatile sig_atomic_t g_interrupted = 0;
void on_interrupt(int) { g_interrupted = 1; }

struct Options {
  std::uint64_t seed = 1;
  int trials = 25;
  std::optional<int> only_trial;
  std::string launch = LAUNCH_BIN;
  std::string rdzvd = RDZVD_BIN;
  std::string worker = CHAOS_WORKER_BIN;
  double hang_timeout_s = 30;
  bool verbose = false;
  bool setsid_strict = false;  // setsid escapes fail even without a usable cgroup v2
  // Every launch with --in_place, every worker declaring support and answering each new world
  // (docs/in_place.md): survivors are kept through failures, kills and rounds.
  bool in_place = false;
};

// Whether launch can put a job in a cgroup v2 of its own and kill it with cgroup.kill: only
// then can it catch a process that left its process group and session (a setsid daemon).
// Elsewhere launch falls back to process groups (docs/launch.md), and such an escape is
// reported apart, not as a failure, unless --setsid_strict.
bool cgroup_kill_usable() {
  std::string mount;
  std::ifstream mi("/proc/self/mountinfo");
  for (std::string line; std::getline(mi, line);) {
    auto dash = line.find(" - cgroup2 ");
    if (dash == std::string::npos) continue;
    std::istringstream in(line);
    std::string f;
    for (int i = 0; i < 5 && in >> f; ++i) {
    }
    mount = f;
    break;
  }
  if (mount.empty()) return false;
  std::string rel;
  std::ifstream cg("/proc/self/cgroup");
  for (std::string line; std::getline(cg, line);) {
    if (line.rfind("0::", 0) == 0) rel = line.substr(3);
  }
  const std::string dir = mount + rel;
  if (::access((dir + "/cgroup.procs").c_str(), W_OK) != 0 || ::access(dir.c_str(), W_OK) != 0)
    return false;
  int major = 0, minor = 0;
  std::ifstream rel_in("/proc/sys/kernel/osrelease");
  char dot;
  rel_in >> major >> dot >> minor;
  return major > 5 || (major == 5 && minor >= 14);
}

Options g_opt;
bool g_cgroup = false;

int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }
int pidfd_send_signal(int fd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, fd, sig, nullptr, 0));
}

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string signame(int sig) {
  switch (sig) {
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "signal " + std::to_string(sig);
  }
}

// ---- processes of the trial found by the marker ------------------------------------------

struct Marked {
  pid_t pid = 0;
  pid_t ppid = 0;
  char state = '?';
  std::vector<std::string> argv;
  std::string cmdline() const {
    std::string s;
    for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
    return s;
  }
  std::string role() const {  // worker, child, gchild, launch, rdzvd, other
    if (argv.size() >= 2 && fs::path(argv[0]).filename() == fs::path(g_opt.worker).filename())
      return argv[1];
    if (!argv.empty()) return fs::path(argv[0]).filename().string();
    return "?";
  }
};

bool has_marker(pid_t pid, const std::string& marker_entry) {
  const std::string env = slurp("/proc/" + std::to_string(pid) + "/environ");
  std::size_t pos = 0;
  while (pos < env.size()) {
    std::size_t end = env.find('\0', pos);
    if (end == std::string::npos) end = env.size();
    if (env.compare(pos, end - pos, marker_entry) == 0) return true;
    pos = end + 1;
  }
  return false;
}

std::optional<Marked> read_proc(pid_t pid) {
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  auto rp = stat.rfind(')');
  if (rp == std::string::npos || rp + 4 > stat.size()) return std::nullopt;
  Marked m;
  m.pid = pid;
  std::istringstream rest(stat.substr(rp + 2));
  rest >> m.state >> m.ppid;
  std::string cmd = slurp("/proc/" + std::to_string(pid) + "/cmdline");
  std::string cur;
  for (char c : cmd) {
    if (c == '\0') {
      m.argv.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) m.argv.push_back(cur);
  return m;
}

// Live (not zombie) processes carrying `marker_entry`; processes we cannot read are skipped.
std::vector<Marked> scan(const std::string& marker_entry) {
  std::vector<Marked> found;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return found;
  const pid_t self = ::getpid();
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || pid <= 0 || pid == self) continue;
    if (!has_marker(static_cast<pid_t>(pid), marker_entry)) continue;
    auto m = read_proc(static_cast<pid_t>(pid));
    if (m && m->state != 'Z' && m->state != 'X') found.push_back(*m);
  }
  ::closedir(d);
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.pid < b.pid; });
  return found;
}

// Signals `pid` only when it carries the marker; the pidfd pins the process between the check
// and the signal, so a reused pid is never hit.
bool signal_marked(pid_t pid, int sig, const std::string& marker_entry) {
  int fd = pidfd_open(pid);
  if (fd < 0) return false;
  bool ok = has_marker(pid, marker_entry) && pidfd_send_signal(fd, sig) == 0;
  ::close(fd);
  return ok;
}

// ---- processes the harness starts (launch, rdzvd) ----------------------------------------

struct Child {
  std::string name;
  pid_t pid = -1;
  int pidfd = -1, out = -1, err = -1;
  std::string outbuf, errbuf;
  std::optional<int> status;  // raw wait status
  std::vector<int> signals;   // what the harness sent
  bool killed_by_harness = false;
  std::size_t scanned = 0;  // how far outbuf was parsed for "ready" lines

  bool alive() const { return !status.has_value(); }
  std::string describe_status() const {
    if (!status) return "running";
    if (WIFEXITED(*status)) return "exit " + std::to_string(WEXITSTATUS(*status));
    return "killed by " + signame(WTERMSIG(*status));
  }
  void close_fds() {
    for (int* fd : {&pidfd, &out, &err}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
  }
};

std::unique_ptr<Child> spawn(const std::string& name, const std::vector<std::string>& argv,
                             const std::map<std::string, std::string>& set_env) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string k = kv.substr(0, eq);
    // Nothing from the caller's environment may change what launch does.
    if (k.rfind("PET_", 0) == 0 || k == "MUSTER_RDZV_TOKEN" || k == "TORCHELASTIC_ERROR_FILE" ||
        k == kMarker)
      continue;
    env[k] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : set_env) env[k] = v;
  std::vector<std::string> envs;
  for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);

  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw std::runtime_error("pipe");
  }
  const pid_t parent = ::getpid();
  auto c = std::make_unique<Child>();
  c->name = name;
  c->pid = ::fork();
  if (c->pid < 0) throw std::runtime_error("fork");
  if (c->pid == 0) {
    // Own process group (a terminal's Ctrl-C reaches only the harness, which cleans up), and
    // gone with the harness should the harness itself be killed.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    ::signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  c->out = out[0];
  c->err = err[0];
  ::fcntl(c->out, F_SETFL, O_NONBLOCK);
  ::fcntl(c->err, F_SETFL, O_NONBLOCK);
  c->pidfd = pidfd_open(c->pid);
  return c;
}

// ---- one trial -------------------------------------------------------------------------

struct Result {
  int orphans = 0;  // processes
  int setsid_escapes = 0;  // setsid grandchildren left where no cgroup v2 can catch them
  bool hang = false;
  int wrong_exit = 0;
  int temp_left = 0;
  bool harness_error = false;
  bool failed() const {
    return orphans > 0 || hang || wrong_exit > 0 || temp_left > 0 || harness_error;
  }
};

class Trial {
 public:
  Trial(int index, std::uint64_t seed, const fs::path& root)
      : index_(index), seed_(seed), rng_(seed) {
    id_ = "chaos-" + std::to_string(::getpid()) + "-" + std::to_string(index);
    marker_entry_ = std::string(kMarker) + "=" + id_;
    dir_ = root / ("trial-" + std::to_string(index));
    tmp_ = dir_ / "tmp";
    fs::create_directories(tmp_);
  }

  ~Trial() {
    cleanup();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  Result run() {
    try {
      body();
    } catch (const std::exception& e) {
      fail("HARNESS", std::string("harness error: ") + e.what());
      res_.harness_error = true;
    }
    cleanup();
    return res_;
  }

 private:
  // -- random draws
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<std::size_t>(uniform(0, static_cast<int>(v.size()) - 1))];
  }

  void log(const std::string& s) {
    plan_ += s + "\n";
    if (g_opt.verbose) std::printf("  [trial %d] %s\n", index_, s.c_str());
  }
  void fail(const std::string& kind, const std::string& what) {
    failures_.push_back(kind + ": " + what);
  }

  // -- event loop over the pipes and pidfds of the harness's own children
  template <class Pred>
  bool pump_until(Clock::time_point deadline, Pred pred) {
    for (;;) {
      if (pred()) return true;
      if (g_interrupted) throw std::runtime_error("interrupted");
      auto now = Clock::now();
      if (now >= deadline) return false;
      std::vector<pollfd> fds;
      std::vector<std::pair<Child*, int>> what;  // 0 out, 1 err, 2 pidfd
      for (auto& c : all_children()) {
        if (c->out >= 0) fds.push_back({c->out, POLLIN, 0}), what.push_back({c, 0});
        if (c->err >= 0) fds.push_back({c->err, POLLIN, 0}), what.push_back({c, 1});
        if (c->alive() && c->pidfd >= 0) fds.push_back({c->pidfd, POLLIN, 0}), what.push_back({c, 2});
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      int r = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(left + 1, 1000)));
      if (r < 0 && errno != EINTR) throw std::runtime_error("poll");
      if (r <= 0) continue;
      for (std::size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        auto [c, kind] = what[i];
        if (kind == 2) {
          reap(*c, false);
          continue;
        }
        int& fd = kind == 0 ? c->out : c->err;
        std::string& buf = kind == 0 ? c->outbuf : c->errbuf;
        char tmp[65536];
        for (;;) {
          ssize_t n = ::read(fd, tmp, sizeof tmp);
          if (n > 0) {
            buf.append(tmp, static_cast<std::size_t>(n));
            if (kind == 0) count_ready(*c);
            if (buf.size() > (8u << 20)) {  // keep the tail only
              const std::size_t cut = buf.size() - (4u << 20);
              buf.erase(0, cut);
              if (kind == 0) c->scanned = c->scanned > cut ? c->scanned - cut : 0;
            }
            continue;
          }
          if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
          ::close(fd);
          fd = -1;
          break;
        }
        if (kind == 0) count_ready(*c);
      }
    }
  }

  void reap(Child& c, bool block) {
    if (!c.alive()) return;
    int st = 0;
    pid_t r = ::waitpid(c.pid, &st, block ? 0 : WNOHANG);
    if (r == c.pid) c.status = st;
  }

  void count_ready(Child& c) {
    for (;;) {
      auto nl = c.outbuf.find('\n', c.scanned);
      if (nl == std::string::npos) break;
      if (c.outbuf.substr(c.scanned, nl - c.scanned).find("]:ready ") != std::string::npos) {
        ++ready_lines_;
      }
      c.scanned = nl + 1;
    }
  }

  std::vector<Child*> all_children() {
    std::vector<Child*> v;
    for (auto& l : launchers_) v.push_back(l.get());
    if (rdzvd_) v.push_back(rdzvd_.get());
    return v;
  }
  bool launchers_done() {
    return std::none_of(launchers_.begin(), launchers_.end(), [](auto& l) { return l->alive(); });
  }

  void send(Child& c, int sig, const std::string& why) {
    if (!c.alive()) return;
    if (pidfd_send_signal(c.pidfd, sig) == 0) {
      c.signals.push_back(sig);
      log(why + ": " + signame(sig) + " to " + c.name + " (pid " + std::to_string(c.pid) + ")");
    }
  }

  // -- the trial
  void body() {
    static const std::vector<std::string> topologies{"standalone", "c10d", "rdzvd"};
    topology_ = pick(topologies);
    const int agents = topology_ == "standalone" ? 1
                       : topology_ == "c10d"     ? uniform(2, 3)
                                                 : uniform(1, 3);
    const int min_nodes = coin() ? agents : uniform(1, agents);
    const std::string nnodes =
        min_nodes == agents ? std::to_string(agents)
                            : std::to_string(min_nodes) + ":" + std::to_string(agents);
    const int max_restarts = uniform(0, 2);
    const int shutdown_timeout = uniform(1, 2);

    // Workers: what they do and what they start.
    static const std::vector<std::string> modes{"run", "exit", "fail"};
    mode_ = pick(modes);
    std::vector<std::string> wargs{
        "worker",
        "mode=" + mode_,
        "delay=" + std::to_string(uniform(200, 1500)),
        "seed=" + std::to_string(uniform(0, 1000)),
        "fail_until=" + std::to_string(uniform(0, 3)),
        "kids=" + std::to_string(uniform(0, 2)),
        "stubborn_kid=" + std::to_string(uniform(0, 1)),
        "setsid=" + std::to_string(coin(0.3) ? 1 : 0),
        "stubborn=" + std::to_string(coin(0.2) ? 1 : 0),
        "store=" + std::to_string(coin(0.4) ? 1 : 0),
        "in_place=" + std::string(g_opt.in_place ? "1" : "0"),
    };

    std::map<std::string, std::string> env{{kMarker, id_}, {"TMPDIR", tmp_.string()}};
    std::string endpoint;
    if (topology_ == "rdzvd") {
      rdzvd_ = spawn("rdzvd", {g_opt.rdzvd, "--listen", "127.0.0.1:0"}, env);
      std::smatch m;
      static const std::regex re(R"(listening on port (\d+))");
      bool up = pump_until(Clock::now() + 20s, [&] {
        return std::regex_search(rdzvd_->outbuf, m, re) || !rdzvd_->alive();
      });
      if (!up || !rdzvd_->alive()) {
        throw std::runtime_error("rdzvd did not come up: " + rdzvd_->describe_status() + " " +
                                 rdzvd_->errbuf);
      }
      endpoint = "127.0.0.1:" + m[1].str();
    } else if (topology_ == "c10d") {
      endpoint = "127.0.0.1:" + std::to_string(muster::testing::free_port());
    }

    std::string conf =
        "join_timeout=10,last_call_timeout=0.2,keep_alive_interval=0.5,close_timeout=3";
    if (topology_ == "rdzvd") conf += ",is_host=false";
    std::string summary;
    for (int a = 0; a < agents; ++a) {
      std::vector<std::string> argv{g_opt.launch,
                                    "--nproc_per_node=" + std::to_string(uniform(1, 3)),
                                    "--max_restarts=" + std::to_string(max_restarts),
                                    "--shutdown_timeout=" + std::to_string(shutdown_timeout),
                                    "--rdzv_conf=" + conf};
      if (g_opt.in_place) argv.push_back("--in_place");
      if (topology_ == "standalone") {
        argv.push_back("--standalone");
      } else {
        argv.insert(argv.end(), {"--nnodes=" + nnodes, "--rdzv_backend=c10d",
                                 "--rdzv_endpoint=" + endpoint, "--rdzv_id=" + id_});
      }
      argv.push_back(g_opt.worker);
      argv.insert(argv.end(), wargs.begin(), wargs.end());
      std::string cmd;
      for (const auto& s : argv) cmd += (cmd.empty() ? "" : " ") + s;
      log("start launch" + std::to_string(a) + ": " + cmd);
      launchers_.push_back(spawn("launch" + std::to_string(a), argv, env));
    }

    // The first workers' ready lines (or every launcher gone) before the first action.
    pump_until(Clock::now() + 20s, [&] { return ready_lines_ > 0 || launchers_done(); });

    const int actions = uniform(0, 3);
    for (int i = 0; i < actions; ++i) {
      if (coin(0.3)) {
        int seen = ready_lines_;
        pump_until(Clock::now() + 5s, [&] { return ready_lines_ > seen || launchers_done(); });
      }
      auto delay = std::chrono::milliseconds(uniform(0, 1200));
      pump_until(Clock::now() + delay, [] { return false; });
      act();
    }

    // The job may end by itself (workers that exit or fail); a job that does not is stopped
    // as an operator would: SIGTERM or SIGINT to every launch still running.
    auto natural = mode_ == "run" ? std::chrono::milliseconds(uniform(0, 1000))
                                  : std::chrono::milliseconds(15000);
    pump_until(Clock::now() + natural, [&] { return launchers_done(); });
    const int stop_sig = coin() ? SIGTERM : SIGINT;
    for (auto& l : launchers_) send(*l, stop_sig, "stop");

    const auto bound = std::chrono::milliseconds(static_cast<long long>(g_opt.hang_timeout_s * 1000));
    if (!pump_until(Clock::now() + bound, [&] { return launchers_done(); })) {
      std::string what;
      for (auto& l : launchers_) {
        if (l->alive()) what += " " + l->name + " (pid " + std::to_string(l->pid) + ")";
      }
      fail("HANG", "launch still running " + std::to_string(bound.count()) + " ms after the stop:" +
                       what + "\n" + ps());
      res_.hang = true;
      kill_everything();
    }
    if (rdzvd_ && rdzvd_->alive()) {
      send(*rdzvd_, SIGTERM, "end (the daemon's normal stop)");
      if (!pump_until(Clock::now() + 10s, [&] { return !rdzvd_->alive(); })) {
        fail("HANG", "rdzvd still running 10 s after SIGTERM\n" + ps());
        res_.hang = true;
        kill_everything();
      }
    }

    // Exit codes: 0, 1, or 128+N for a signal N sent to that process (death by SIGKILL sent).
    for (Child* c : all_children()) {
      if (c->killed_by_harness || !c->status) continue;
      const int st = *c->status;
      bool ok = false;
      auto sent = [&](int sig) {
        return std::find(c->signals.begin(), c->signals.end(), sig) != c->signals.end();
      };
      if (WIFEXITED(st)) {
        int code = WEXITSTATUS(st);
        ok = (c != rdzvd_.get() && (code == 0 || code == 1)) || (c == rdzvd_.get() && code == 0) ||
             (code > 128 && sent(code - 128));
      } else if (WIFSIGNALED(st)) {
        ok = WTERMSIG(st) == SIGKILL && sent(SIGKILL);
      }
      if (!ok) {
        std::string sigs;
        for (int s : c->signals) sigs += " " + signame(s);
        fail("EXIT", c->name + " " + c->describe_status() + " (signals sent:" +
                         (sigs.empty() ? " none" : sigs) + ")\n" + tail(c->errbuf, 15));
        ++res_.wrong_exit;
      }
    }

    check_orphans();
    check_temp();
  }

  void act() {
    std::vector<std::string> kinds;
    if (std::any_of(launchers_.begin(), launchers_.end(), [](auto& l) { return l->alive(); }))
      kinds.push_back("launch");
    if (rdzvd_ && rdzvd_->alive()) kinds.push_back("rdzvd");
    auto procs = scan(marker_entry_);
    std::vector<Marked> workers, kids;
    for (const auto& m : procs) {
      auto r = m.role();
      if (r == "worker") workers.push_back(m);
      if (r == "child" || r == "gchild") kids.push_back(m);
    }
    if (!workers.empty()) kinds.push_back("worker"), kinds.push_back("worker");
    if (!kids.empty()) kinds.push_back("child");
    if (kinds.empty()) {
      log("action: nothing left to hit");
      return;
    }
    const std::string kind = pick(kinds);
    static const std::vector<int> sigs{SIGKILL, SIGTERM, SIGINT};
    const int sig = pick(sigs);
    if (kind == "launch") {
      std::vector<Child*> alive;
      for (auto& l : launchers_) {
        if (l->alive()) alive.push_back(l.get());
      }
      send(*pick(alive), sig, "action");
    } else if (kind == "rdzvd") {
      send(*rdzvd_, sig, "action");
    } else {
      const Marked& m = pick(kind == "worker" ? workers : kids);
      if (signal_marked(m.pid, sig, marker_entry_)) {
        log("action: " + signame(sig) + " to " + m.role() + " pid " + std::to_string(m.pid) +
            " (" + m.cmdline() + ")");
      }
    }
  }

  // Every live marked process, waited for on pidfds up to a settling bound; what is left is
  // an orphan (reported, then killed).
  void check_orphans() {
    const auto settle_until = Clock::now() + 5s;
    std::vector<Marked> left;
    for (int round = 0; round < 3; ++round) {
      left = scan(marker_entry_);
      if (left.empty()) break;
      std::vector<int> fds;
      for (const auto& m : left) {
        int fd = pidfd_open(m.pid);
        if (fd >= 0) fds.push_back(fd);
      }
      while (!fds.empty() && Clock::now() < settle_until) {
        std::vector<pollfd> p;
        for (int fd : fds) p.push_back({fd, POLLIN, 0});
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(settle_until - Clock::now());
        int r = ::poll(p.data(), p.size(), static_cast<int>(std::max<long long>(ms.count(), 0)));
        if (r <= 0) break;
        std::vector<int> still;
        for (std::size_t i = 0; i < p.size(); ++i) {
          if (p[i].revents != 0)
            ::close(p[i].fd);
          else
            still.push_back(p[i].fd);
        }
        fds = still;
      }
      for (int fd : fds) ::close(fd);
      if (Clock::now() >= settle_until) {
        left = scan(marker_entry_);
        break;
      }
    }
    if (left.empty()) return;
    if (!g_cgroup && !g_opt.setsid_strict &&
        std::all_of(left.begin(), left.end(), [](auto& m) { return m.role() == "gchild"; })) {
      res_.setsid_escapes += static_cast<int>(left.size());
      log("setsid escape(s) not counted (no usable cgroup v2 here): " +
          std::to_string(left.size()));
      kill_everything();
      return;
    }
    std::string what;
    for (const auto& m : left) {
      auto parent = read_proc(m.ppid);
      what += "  pid " + std::to_string(m.pid) + " state " + m.state + " parent " +
              std::to_string(m.ppid) + (parent ? " (" + parent->cmdline().substr(0, 60) + ")" : "") + ": " +
              m.cmdline() + "\n";
    }
    res_.orphans += static_cast<int>(left.size());
    orphan_roles_.clear();
    for (const auto& m : left) orphan_roles_.push_back(m.role());
    fail("ORPHAN", std::to_string(left.size()) + " process(es) of the trial still alive after " +
                       "every launch and rdzvd exited:\n" + what);
    kill_everything();
  }

  void check_temp() {
    std::string what;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(tmp_, ec)) {
      what += "  " + e.path().string() + "\n";
      ++res_.temp_left;
    }
    if (res_.temp_left > 0) fail("TEMP", "left in the trial's TMPDIR:\n" + what);
  }

  std::string ps() {
    std::string s = "  still running with the marker:\n";
    for (const auto& m : scan(marker_entry_)) {
      s += "    pid " + std::to_string(m.pid) + " ppid " + std::to_string(m.ppid) + " " +
           m.state + " " + m.cmdline() + "\n";
    }
    return s;
  }

  static std::string tail(const std::string& s, int lines) {
    std::size_t start = s.size();
    int seen = 0;
    while (start > 0) {
      if (s[start - 1] == '\n' && start != s.size() && ++seen == lines) break;
      --start;
    }
    return s.substr(start);
  }

  // SIGKILL to everything of the trial: the harness's own children by pidfd, the rest by the
  // marker; repeated until nothing is found (a process may fork while we kill).
  void kill_everything() {
    for (Child* c : all_children()) {
      if (c->alive()) {
        pidfd_send_signal(c->pidfd, SIGKILL);
        c->killed_by_harness = true;
      }
    }
    for (int i = 0; i < 50; ++i) {
      auto left = scan(marker_entry_);
      if (left.empty()) break;
      std::vector<int> fds;
      for (const auto& m : left) {
        int fd = pidfd_open(m.pid);
        if (fd < 0) continue;
        if (has_marker(m.pid, marker_entry_)) pidfd_send_signal(fd, SIGKILL);
        fds.push_back(fd);
      }
      for (int fd : fds) {
        pollfd p{fd, POLLIN, 0};
        ::poll(&p, 1, 200);
        ::close(fd);
      }
    }
    for (Child* c : all_children()) reap(*c, true);
  }

  // Runs on every path: nothing of the trial survives the trial.
  void cleanup() {
    if (cleaned_) return;
    cleaned_ = true;
    bool any = !scan(marker_entry_).empty();
    for (Child* c : all_children()) any = any || c->alive();
    if (any) kill_everything();
    for (Child* c : all_children()) c->close_fds();
  }

 public:
  void report(std::uint64_t run_seed) {
    if (failures_.empty()) return;
    std::printf("FAIL trial %d (seed %llu, trial seed %llu; reproduce: chaos --seed %llu --trial %d)\n",
                index_, static_cast<unsigned long long>(run_seed),
                static_cast<unsigned long long>(seed_), static_cast<unsigned long long>(run_seed),
                index_);
    std::printf("  topology %s, workers %s\n", topology_.c_str(), mode_.c_str());
    if (!g_opt.verbose) {
      std::istringstream in(plan_);
      for (std::string l; std::getline(in, l);) std::printf("  | %s\n", l.c_str());
    }
    for (const auto& f : failures_) {
      std::istringstream in(f);
      bool first = true;
      for (std::string l; std::getline(in, l);) {
        std::printf("  %s%s\n", first ? "" : "    ", l.c_str());
        first = false;
      }
    }
    std::fflush(stdout);
  }
  const std::vector<std::string>& orphan_roles() const { return orphan_roles_; }
  const std::string& topology() const { return topology_; }

 private:
  int index_;
  std::uint64_t seed_;
  std::mt19937_64 rng_;
  std::string id_, marker_entry_;
  fs::path dir_, tmp_;
  std::string topology_, mode_;
  std::vector<std::unique_ptr<Child>> launchers_;
  std::unique_ptr<Child> rdzvd_;
  int ready_lines_ = 0;
  std::string plan_;
  std::vector<std::string> failures_;
  std::vector<std::string> orphan_roles_;
  Result res_;
  bool cleaned_ = false;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "chaos: %s\nusage: chaos [--seed S] [--trials N] [--trial K] [--launch PATH] "
               "[--rdzvd PATH] [--worker PATH] [--hang_timeout SECONDS] [--setsid_strict] "
               "[--in_place] [--verbose]\n",
               msg);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  bool seed_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      auto eq = a.find('=');
      if (eq != std::string::npos) return a.substr(eq + 1);
      if (i + 1 >= argc) usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    auto key = a.substr(0, a.find('='));
    if (key == "--seed") {
      g_opt.seed = std::stoull(value());
      seed_given = true;
    } else if (key == "--trials") {
      g_opt.trials = std::stoi(value());
    } else if (key == "--trial") {
      g_opt.only_trial = std::stoi(value());
    } else if (key == "--launch") {
      g_opt.launch = value();
    } else if (key == "--rdzvd") {
      g_opt.rdzvd = value();
    } else if (key == "--worker") {
      g_opt.worker = value();
    } else if (key == "--hang_timeout") {
      g_opt.hang_timeout_s = std::stod(value());
    } else if (key == "--setsid_strict") {
      g_opt.setsid_strict = true;
    } else if (key == "--in_place") {
      g_opt.in_place = true;
    } else if (key == "--verbose" || key == "-v") {
      g_opt.verbose = true;
    } else if (key == "--help" || key == "-h") {
      usage("randomized fault trials of launch, rdzvd and workers");
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (!seed_given) {
    g_opt.seed = static_cast<std::uint64_t>(
        std::chrono::system_clock::now().time_since_epoch().count() % 1000000007);
  }
  for (const auto& p : {g_opt.launch, g_opt.rdzvd, g_opt.worker}) {
    if (::access(p.c_str(), X_OK) != 0) usage(("not executable: " + p).c_str());
  }
  struct sigaction sa{};
  sa.sa_handler = on_interrupt;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGHUP, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  g_cgroup = cgroup_kill_usable();
  const char* t = std::getenv("TMPDIR");
  std::string root_tmpl = std::string(t != nullptr && *t ? t : "/tmp") + "/muster_chaos_XXXXXX";
  if (::mkdtemp(root_tmpl.data()) == nullptr) usage("cannot create the test root");
  const fs::path root = root_tmpl;

  std::printf("chaos: seed %llu, cgroup v2 %s, %s\n", static_cast<unsigned long long>(g_opt.seed),
              g_cgroup ? "usable (setsid escapes are failures)"
                       : "not usable (setsid escapes reported apart)",
              g_opt.only_trial ? ("trial " + std::to_string(*g_opt.only_trial)).c_str()
                               : (std::to_string(g_opt.trials) + " trials").c_str());
  std::fflush(stdout);

  int setsid_escapes = 0;
  int run = 0, orphan_procs = 0, orphan_trials = 0, hangs = 0, wrong_exits = 0, temps = 0,
      harness = 0;
  std::map<std::string, int> orphan_by_role, fail_by_topology;
  std::vector<int> failing;
  const auto started = Clock::now();
  const int first = g_opt.only_trial.value_or(0);
  const int last = g_opt.only_trial ? *g_opt.only_trial + 1 : g_opt.trials;
  for (int k = first; k < last && !g_interrupted; ++k) {
    const std::uint64_t tseed = splitmix64(g_opt.seed ^ splitmix64(static_cast<std::uint64_t>(k)));
    Trial trial(k, tseed, root);
    Result r = trial.run();
    if (g_interrupted) break;
    ++run;
    trial.report(g_opt.seed);
    orphan_procs += r.orphans;
    setsid_escapes += r.setsid_escapes;
    orphan_trials += r.orphans > 0;
    for (const auto& role : trial.orphan_roles()) ++orphan_by_role[role];
    hangs += r.hang;
    wrong_exits += r.wrong_exit > 0;
    temps += r.temp_left > 0;
    harness += r.harness_error;
    if (r.failed()) {
      failing.push_back(k);
      ++fail_by_topology[trial.topology()];
    }
    if (g_opt.verbose) std::printf("trial %d: %s\n", k, r.failed() ? "FAILED" : "ok");
  }
  std::error_code ec;
  fs::remove_all(root, ec);

  // The harness itself leaks nothing: no process of any of this run's trials is left.
  const std::string run_prefix = std::string(kMarker) + "=chaos-" + std::to_string(::getpid()) + "-";
  int leaked = 0;
  if (DIR* d = ::opendir("/proc")) {
    while (dirent* e = ::readdir(d)) {
      char* end = nullptr;
      long pid = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0' || pid <= 0 || pid == ::getpid()) continue;
      std::string env = slurp("/proc/" + std::string(e->d_name) + "/environ");
      if (env.find(run_prefix) == std::string::npos) continue;
      auto m = read_proc(static_cast<pid_t>(pid));
      if (!m || m->state == 'Z') continue;
      std::printf("HARNESS LEAK: pid %ld %s\n", pid, m->cmdline().c_str());
      ++leaked;
    }
    ::closedir(d);
  }
  if (leaked > 0) ++harness;

  const double secs = std::chrono::duration<double>(Clock::now() - started).count();
  std::printf("chaos summary: seed %llu, %d trials in %.0f s; orphans %d (in %d trials",
              static_cast<unsigned long long>(g_opt.seed), run, secs, orphan_procs,
              orphan_trials);
  for (const auto& [role, n] : orphan_by_role) std::printf(", %s %d", role.c_str(), n);
  std::printf("), hangs %d, wrong exit codes %d, leftover temp folders %d", hangs, wrong_exits,
              temps);
  if (harness > 0) std::printf(", harness errors %d", harness);
  if (setsid_escapes > 0) std::printf(", setsid escapes not counted %d", setsid_escapes);
  std::printf("; failing trials:");
  if (failing.empty()) std::printf(" none");
  for (int k : failing) std::printf(" %d", k);
  if (!fail_by_topology.empty()) {
    std::printf(" (");
    bool first_t = true;
    for (const auto& [topo, n] : fail_by_topology) {
      std::printf("%s%s %d", first_t ? "" : ", ", topo.c_str(), n);
      first_t = false;
    }
    std::printf(")");
  }
  std::printf("\n");
  if (!failing.empty()) {
    std::printf("reproduce one: chaos --seed %llu --trial K --verbose\n",
                static_cast<unsigned long long>(g_opt.seed));
  }
  if (g_interrupted) {
    std::printf("chaos: interrupted\n");
    return 130;
  }
  return failing.empty() && harness == 0 ? 0 : 1;
}
