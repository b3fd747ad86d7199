#include "etcd_cluster.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace muster::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// etcd and etcdctl as found on PATH ("" where missing: the tests then skip).
const std::string& etcd_bin() {
  static const std::string p = find_on_path("etcd");
  return p;
}
const std::string& etcdctl_bin() {
  static const std::string p = find_on_path("etcdctl");
  return p;
}
constexpr auto kKillBound = std::chrono::seconds(10);     // kill -9 until the member is gone
constexpr auto kCtlTimeout = std::chrono::seconds(5);     // ctl(): etcdctl's dial and command
constexpr auto kStatusTimeout = std::chrono::seconds(1);  // leader(): per member
constexpr auto kHealthTry = std::chrono::seconds(1);      // healthy(): one try's bound
constexpr auto kHealthPause = milliseconds(50);           // healthy(): after a quick failure
constexpr auto kCtlSlack = std::chrono::seconds(10);      // etcdctl's own bounds, plus this
constexpr std::size_t kLogTail = 4000;                    // chars of a member's log in errors

// A member that exited because a port of its was taken after free_port() checked it.
struct PortTaken : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string ms_flag(milliseconds d) { return std::to_string(d.count()) + "ms"; }

milliseconds left_until(Clock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

// This process's environment less what etcd or etcdctl would read as flags or as a readiness
// socket (ETCD_*, ETCDCTL_*, NOTIFY_SOCKET): the members and checks must not depend on it.
bool foreign(const std::string& name) {
  return name.rfind("ETCD_", 0) == 0 || name.rfind("ETCDCTL_", 0) == 0 || name == "NOTIFY_SOCKET";
}

struct CtlResult {
  std::optional<int> code;  // nullopt: did not end within its bound (killed by Proc)
  std::string out, err;
};

CtlResult run_etcdctl(const std::string& endpoints, milliseconds timeout,
                      const std::vector<std::string>& args) {
  std::vector<std::string> argv = {etcdctl_bin(), "--endpoints=" + endpoints,
                                   "--dial-timeout=" + ms_flag(timeout),
                                   "--command-timeout=" + ms_flag(timeout)};
  argv.insert(argv.end(), args.begin(), args.end());
  std::map<std::string, std::optional<std::string>> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    std::string name = kv.substr(0, kv.find('='));
    if (foreign(name)) env[name] = std::nullopt;
  }
  env["ETCDCTL_API"] = "3";
  Proc p(argv, env);
  CtlResult r;
  // Dial and command each take up to `timeout`; the slack covers etcdctl's own start.
  r.code = p.wait(2 * timeout + kCtlSlack);
  r.out = p.out();
  r.err = p.err();
  return r;
}

std::vector<std::string> split(const std::string& s, const std::string& sep) {
  std::vector<std::string> out;
  std::size_t from = 0;
  for (;;) {
    auto at = s.find(sep, from);
    out.push_back(s.substr(from, at == std::string::npos ? std::string::npos : at - from));
    if (at == std::string::npos) return out;
    from = at + sep.size();
  }
}

}  // namespace

std::string EtcdCluster::missing() {
  if (etcd_bin().empty()) return "no etcd on PATH (Debian's etcd-server)";
  if (etcdctl_bin().empty()) return "no etcdctl on PATH (Debian's etcd-client)";
  return "";
}

std::string EtcdCluster::data_base() {
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0) {
    return "/dev/shm";
  }
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp ? tmp : "/tmp";
}

EtcdCluster::EtcdCluster(EtcdOptions o) : options_(o) {
  // mkdtemp made the folder's name unique among this TMPDIR's; the pid separates TMPDIRs.
  token_ = "muster-" + std::to_string(::getpid()) + "-" +
           std::filesystem::path(dir_.path()).filename().string();
}

std::unique_ptr<EtcdCluster> EtcdCluster::start(EtcdOptions o) {
  if (o.members < 1) throw std::invalid_argument("EtcdCluster: members must be at least 1");
  if (o.heartbeat.count() <= 0 || o.election.count() <= 0 || o.ready.count() <= 0)
    throw std::invalid_argument("EtcdCluster: heartbeat, election and ready must be positive");
  if (std::string why = missing(); !why.empty()) throw std::runtime_error("EtcdCluster: " + why);
  for (int attempt = 0;; ++attempt) {
    std::unique_ptr<EtcdCluster> c(new EtcdCluster(o));
    try {
      c->start_members();
      return c;
    } catch (const PortTaken& e) {
      // Another process bound a port between free_port() and etcd: once more with new ones.
      // (c's destructor ends the members started so far.)
      if (attempt == 1) throw std::runtime_error(std::string(e.what()) + " (a retry, new ports)");
    }
  }
}

void EtcdCluster::start_members() {
  std::set<int> used;
  auto fresh_port = [&used] {
    for (int i = 0; i < 100; ++i) {
      const int p = free_port();
      if (p > 0 && used.insert(p).second) return p;
    }
    throw std::runtime_error("EtcdCluster: no free port found in 100 tries");
  };
  members_.resize(static_cast<std::size_t>(options_.members));
  for (int i = 0; i < size(); ++i) {
    Member& m = members_[static_cast<std::size_t>(i)];
    m.name = "m" + std::to_string(i);
    m.client_port = fresh_port();
    m.peer_port = fresh_port();
    m.notify = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (m.notify < 0)
      throw std::runtime_error(std::string("EtcdCluster: socket: ") + std::strerror(errno));
    const std::string name = notify_name(i);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    // Abstract (leading NUL): no path length limit from TMPDIR, nothing left in the folder.
    std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof a.sun_path - 1));
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (::bind(m.notify, reinterpret_cast<sockaddr*>(&a), len) != 0)
      throw std::runtime_error("EtcdCluster: cannot bind the notify socket @" + name + ": " +
                               std::strerror(errno));
  }
  std::vector<int> all;
  for (int i = 0; i < size(); ++i) {
    spawn(i, false);
    all.push_back(i);
  }
  wait_ready(all);
}

std::string EtcdCluster::notify_name(int i) const {
  return token_ + "-" + members_.at(static_cast<std::size_t>(i)).name;
}

void EtcdCluster::spawn(int i, bool existing) {
  Member& m = members_.at(static_cast<std::size_t>(i));
  auto peer_url = [](const Member& x) { return "http://127.0.0.1:" + std::to_string(x.peer_port); };
  const std::string client_url = "http://127.0.0.1:" + std::to_string(m.client_port);
  std::string cluster;
  for (const Member& x : members_)
    cluster += (cluster.empty() ? "" : ",") + x.name + "=" + peer_url(x);
  const std::vector<std::string> argv = {
      etcd_bin(),
      "--name=" + m.name,
      "--data-dir=" + dir_.file(m.name),
      "--listen-peer-urls=" + peer_url(m),
      "--initial-advertise-peer-urls=" + peer_url(m),
      "--listen-client-urls=" + client_url,
      "--advertise-client-urls=" + client_url,
      "--initial-cluster=" + cluster,
      "--initial-cluster-token=" + token_,
      std::string("--initial-cluster-state=") + (existing ? "existing" : "new"),
      "--heartbeat-interval=" + std::to_string(options_.heartbeat.count()),
      "--election-timeout=" + std::to_string(options_.election.count()),
      // zap at warn: a few lines per peer connection and loss instead of every raft step.
      "--logger=zap",
      "--log-outputs=stderr",
      "--log-level=warn",
  };
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    if (!foreign(kv.substr(0, kv.find('=')))) envs.push_back(kv);
  }
  envs.push_back("NOTIFY_SOCKET=@" + notify_name(i));  // Go dials "@x" as abstract
  std::vector<char*> cargv, cenv;
  for (const auto& s : argv) cargv.push_back(const_cast<char*>(s.c_str()));
  cargv.push_back(nullptr);
  for (const auto& s : envs) cenv.push_back(const_cast<char*>(s.c_str()));
  cenv.push_back(nullptr);

  // A READY=1 left from the member's previous life must not count for this one.
  char drain[256];
  while (::recv(m.notify, drain, sizeof drain, 0) >= 0) {
  }
  // stderr to a file, not a pipe: nobody drains a pipe while a test runs, and a full one
  // would stall the member.
  const int log = ::open(log_path(i).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (log < 0 || null < 0) {
    if (log >= 0) ::close(log);
    if (null >= 0) ::close(null);
    throw std::runtime_error("EtcdCluster: cannot open " + log_path(i) + " or /dev/null");
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Only async-signal-safe calls here (the test process may have threads).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    ::dup2(null, 0);
    ::dup2(log, 1);
    ::dup2(log, 2);
    ::syscall(SYS_close_range, 3U, ~0U, 0U);  // no fd of the test's (sockets, pipes) leaks in
    ::execve(etcd_bin().c_str(), cargv.data(), cenv.data());
    static const char msg[] = "EtcdCluster: cannot exec etcd\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(log);
  ::close(null);
  if (pid < 0)
    throw std::runtime_error(std::string("EtcdCluster: fork: ") + std::strerror(fork_errno));
  m.pid = pid;
  m.exit_code.reset();
  m.pidfd = open_pidfd(pid);
  if (m.pidfd < 0) {
    ::kill(pid, SIGKILL);
    reap(i);
    throw std::runtime_error(std::string("EtcdCluster: pidfd_open: ") + std::strerror(errno));
  }
}

void EtcdCluster::wait_ready(const std::vector<int>& which) {
  const auto deadline = Clock::now() + options_.ready;
  std::set<int> pending(which.begin(), which.end());
  while (!pending.empty()) {
    std::vector<pollfd> fds;
    std::vector<int> owner;
    for (int i : pending) {
      const Member& m = members_.at(static_cast<std::size_t>(i));
      fds.push_back({m.pidfd, POLLIN, 0});
      fds.push_back({m.notify, POLLIN, 0});
      owner.push_back(i);
    }
    const int r = ::poll(fds.data(), fds.size(), static_cast<int>(left_until(deadline).count()));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      const int i = *pending.begin();
      throw std::runtime_error("EtcdCluster: member " + members_[static_cast<std::size_t>(i)].name +
                               " was not ready within " + std::to_string(options_.ready.count()) +
                               " ms; its log: " + log_tail(i));
    }
    for (std::size_t k = 0; k < owner.size(); ++k) {
      const int i = owner[k];
      Member& m = members_[static_cast<std::size_t>(i)];
      // An exit first: etcd also says READY=1 when its start was aborted, then exits.
      if (fds[2 * k].revents != 0) {
        reap(i);
        const std::string log = log_tail(i);
        const std::string what = "EtcdCluster: member " + m.name + " exited with " +
                                 std::to_string(m.exit_code.value_or(-1)) +
                                 " before it was ready; its log: " + log;
        if (log.find("address already in use") != std::string::npos) throw PortTaken(what);
        throw std::runtime_error(what);
      }
      if (fds[2 * k + 1].revents != 0) {
        char buf[256];
        const ssize_t n = ::recv(m.notify, buf, sizeof buf, 0);
        if (n > 0 &&
            std::string(buf, static_cast<std::size_t>(n)).find("READY=1") != std::string::npos)
          pending.erase(i);
      }
    }
  }
}

void EtcdCluster::reap(int i) {
  Member& m = members_.at(static_cast<std::size_t>(i));
  if (m.pid <= 0 || m.exit_code) return;
  int st = 0;
  if (::waitpid(m.pid, &st, 0) == m.pid)
    m.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  else
    m.exit_code = -1;
  if (m.pidfd >= 0) ::close(m.pidfd);
  m.pidfd = -1;
}

EtcdCluster::~EtcdCluster() {
  for (const Member& m : members_) {
    if (m.pid > 0 && !m.exit_code) ::kill(m.pid, SIGKILL);
  }
  for (int i = 0; i < size(); ++i) {
    Member& m = members_[static_cast<std::size_t>(i)];
    // Reaped only once gone: a waitpid on a member stuck in the kernel would hang the test.
    if (m.pid > 0 && !m.exit_code && wait_pidfd(m.pidfd, kKillBound)) reap(i);
    if (m.pidfd >= 0) ::close(m.pidfd);
    if (m.notify >= 0) ::close(m.notify);
  }
  // dir_ (data dirs and logs) goes after this body.
}

std::string EtcdCluster::endpoint(int i) const {
  return "127.0.0.1:" + std::to_string(members_.at(static_cast<std::size_t>(i)).client_port);
}

std::string EtcdCluster::endpoints() const {
  std::string out;
  for (int i = 0; i < size(); ++i) out += (i ? "," : "") + endpoint(i);
  return out;
}

std::string EtcdCluster::running_endpoints() const {
  std::string out;
  for (int i = 0; i < size(); ++i) {
    if (running(i)) out += (out.empty() ? "" : ",") + endpoint(i);
  }
  return out;
}

std::string EtcdCluster::log_path(int i) const {
  return dir_.file(members_.at(static_cast<std::size_t>(i)).name + ".log");
}

std::string EtcdCluster::log_tail(int i) const {
  std::string log = trim_end(read_file(log_path(i)));
  return log.size() > kLogTail ? "..." + log.substr(log.size() - kLogTail) : log;
}

pid_t EtcdCluster::pid(int i) const { return members_.at(static_cast<std::size_t>(i)).pid; }

bool EtcdCluster::running(int i) const {
  const Member& m = members_.at(static_cast<std::size_t>(i));
  return m.pid > 0 && !m.exit_code && !wait_pidfd(m.pidfd, milliseconds(0));
}

void EtcdCluster::kill(int i) {
  Member& m = members_.at(static_cast<std::size_t>(i));
  if (!running(i)) throw std::runtime_error("EtcdCluster: member " + m.name + " is not running");
  ::kill(m.pid, SIGKILL);
  if (!wait_pidfd(m.pidfd, kKillBound))
    throw std::runtime_error("EtcdCluster: member " + m.name + " (pid " + std::to_string(m.pid) +
                             ") still there 10 s after SIGKILL");
  reap(i);
}

void EtcdCluster::restart(int i, bool wait) {
  Member& m = members_.at(static_cast<std::size_t>(i));
  if (running(i)) throw std::runtime_error("EtcdCluster: member " + m.name + " is running");
  reap(i);  // one that exited by itself
  spawn(i, true);
  if (wait) wait_ready({i});
}

bool EtcdCluster::healthy(milliseconds timeout) const {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const std::string eps = running_endpoints();
    const milliseconds left = left_until(deadline);
    if (eps.empty() || left.count() == 0) return false;
    // Dial and read each get half of what is left (at most kHealthTry, at least 50 ms).
    const milliseconds per = std::clamp<milliseconds>(left / 2, milliseconds(50), kHealthTry);
    const auto tried = Clock::now();
    if (run_etcdctl(eps, per, {"endpoint", "health"}).code == 0) return true;
    // A refused connection fails at once; pause so that the retries do not spin.
    if (Clock::now() - tried < kHealthPause)
      ::poll(nullptr, 0, static_cast<int>(std::min(kHealthPause, left_until(deadline)).count()));
  }
}

int EtcdCluster::leader() const {
  const std::string eps = running_endpoints();
  if (eps.empty()) return -1;
  // One line per member that answered: "endpoint, id, version, db size, is leader, is
  // learner, raft term, raft index, raft applied index, errors". Those that did not answer
  // are only on stderr (and make the exit code 1).
  const CtlResult r = run_etcdctl(eps, std::chrono::duration_cast<milliseconds>(kStatusTimeout),
                                  {"endpoint", "status", "-w", "simple"});
  int best = -1;
  long best_term = -1;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    const std::vector<std::string> f = split(line, ", ");
    if (f.size() < 7 || f[4] != "true") continue;
    for (int i = 0; i < size(); ++i) {
      if (f[0] != endpoint(i)) continue;
      const long term = std::strtol(f[6].c_str(), nullptr, 10);
      if (term > best_term) {
        best = i;
        best_term = term;
      }
    }
  }
  return best;
}

std::string EtcdCluster::ctl(const std::vector<std::string>& args, int member) const {
  const std::string eps = member < 0 ? running_endpoints() : endpoint(member);
  if (eps.empty()) throw std::runtime_error("EtcdCluster: ctl: no member is running");
  const CtlResult r = run_etcdctl(eps, std::chrono::duration_cast<milliseconds>(kCtlTimeout), args);
  if (r.code != 0) {
    std::string cmd = "etcdctl --endpoints=" + eps;
    for (const auto& a : args) cmd += " " + a;
    throw std::runtime_error("EtcdCluster: `" + cmd + "` failed (" +
                             (r.code ? "exit " + std::to_string(*r.code) : "timed out") +
                             "): " + trim_end(r.err));
  }
  return r.out;
}

}  // namespace muster::testing
