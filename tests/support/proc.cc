#include "proc.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <mutex>
#include <stdexcept>
#include <utility>

extern char** environ;

namespace muster::testing {

Proc::Proc(const std::vector<std::string>& argv,
           const std::map<std::string, std::optional<std::string>>& env) {
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) merged[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : env) {
    if (v)
      merged[k] = *v;
    else
      merged.erase(k);
  }
  std::vector<std::string> envs;
  for (const auto& [k, v] : merged) envs.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
    throw std::runtime_error("pipe");
  pid_ = ::fork();
  if (pid_ == 0) {
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  out_fd_ = out[0];
  err_fd_ = err[0];
  pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
}

Proc::~Proc() {
  if (!status_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
  for (int fd : {pidfd_, out_fd_, err_fd_}) {
    if (fd >= 0) ::close(fd);
  }
}

// Polls the pipes (and the pidfd when waiting for exit) until the deadline.
// Returns true when there was progress (data, EOF or exit).
bool Proc::pump(std::chrono::steady_clock::time_point deadline, bool want_exit) {
  pollfd fds[3];
  int n = 0;
  int out_idx = -1, err_idx = -1, pid_idx = -1;
  if (out_fd_ >= 0) {
    out_idx = n;
    fds[n++] = {out_fd_, POLLIN, 0};
  }
  if (err_fd_ >= 0) {
    err_idx = n;
    fds[n++] = {err_fd_, POLLIN, 0};
  }
  if (want_exit && !status_ && pidfd_ >= 0) {
    pid_idx = n;
    fds[n++] = {pidfd_, POLLIN, 0};
  }
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  if (left.count() < 0) return false;
  if (n == 0) return false;
  int r = ::poll(fds, n, static_cast<int>(left.count()));
  if (r < 0 && errno == EINTR) return true;
  if (r <= 0) return false;
  char buf[65536];
  auto drain = [&](int idx, int& fd, std::string& into) {
    if (idx < 0 || fds[idx].revents == 0) return;
    ssize_t got = ::read(fd, buf, sizeof buf);
    if (got > 0) {
      into.append(buf, static_cast<std::size_t>(got));
    } else {
      ::close(fd);
      fd = -1;
    }
  };
  drain(out_idx, out_fd_, out_);
  drain(err_idx, err_fd_, err_);
  if (pid_idx >= 0 && fds[pid_idx].revents != 0) {
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
  }
  return true;
}

bool Proc::wait_output(const std::function<bool(const std::string&, const std::string&)>& pred,
                       std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred(out_, err_)) {
    if (out_fd_ < 0 && err_fd_ < 0) return false;
    if (!pump(deadline, false)) return pred(out_, err_);
  }
  return true;
}

std::optional<int> Proc::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!status_ || out_fd_ >= 0 || err_fd_ >= 0) {
    if (!pump(deadline, true)) break;
  }
  return status_;
}

int open_pidfd(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

bool wait_pidfd(int pidfd, std::chrono::milliseconds timeout) {
  if (pidfd < 0) return true;  // ESRCH when opened: already gone
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(timeout.count())) == 1;
}

TempDir::TempDir() : TempDir([] {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp ? tmp : "/tmp");
}()) {}

TempDir::TempDir(const std::string& base) {
  std::string t = base + "/muster_test_XXXXXX";
  if (::mkdtemp(t.data()) == nullptr) throw std::runtime_error("mkdtemp under " + base);
  path_ = t;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string trim_end(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

int count_lines_with(const std::string& text, const std::string& needle) {
  int n = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.find(needle) != std::string::npos) ++n;
  }
  return n;
}

namespace {

// free_port()'s ports: a range the kernel never hands out by itself (below, or else above,
// net.ipv4.ip_local_port_range, where bind(0) and connect() pick), so no socket of any
// process takes one between the check and the program's bind. Each port handed out is held
// by an flock on kPortLockDir/<port> for as long as this process lives (released by the
// kernel when it exits, however it ends; the fd is not inherited), so no other test process
// running beside it (ctest -j) is given the same one.
constexpr const char* kPortLockDir = "/tmp/muster-test-ports";
constexpr int kPortSpan = 8000;

std::pair<int, int> reserved_range() {
  int lo = 32768, hi = 60999;
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  in >> lo >> hi;
  if (lo - 1024 >= 2000) return {std::max(1024, lo - kPortSpan), lo - 1};
  return {hi + 1, std::min(65535, hi + kPortSpan)};
}

bool can_bind(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

std::mutex g_ports_mu;
std::vector<int> g_port_locks;  // fds holding this process's ports, open until it exits

// Takes `port` for this process: its lock (not held by any other process, nor by this one
// before) and a bind that works now. False, holding nothing, otherwise.
bool reserve(int port) {
  if (::mkdir(kPortLockDir, 01777) == 0) ::chmod(kPortLockDir, 01777);  // past the umask: shared
  const std::string path = std::string(kPortLockDir) + "/" + std::to_string(port);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return false;
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || !can_bind(port)) {
    ::close(fd);
    return false;
  }
  g_port_locks.push_back(fd);
  return true;
}

void release(int port) {
  const std::string path = std::string(kPortLockDir) + "/" + std::to_string(port);
  struct stat want {};
  if (::stat(path.c_str(), &want) != 0) return;
  for (auto it = g_port_locks.begin(); it != g_port_locks.end(); ++it) {
    struct stat got {};
    if (::fstat(*it, &got) == 0 && got.st_ino == want.st_ino && got.st_dev == want.st_dev) {
      ::close(*it);
      g_port_locks.erase(it);
      return;
    }
  }
}

// The first free port (or pair) from a starting point of this process's own, 0 when none.
int take(int count) {
  std::lock_guard<std::mutex> lock(g_ports_mu);
  const auto [lo, hi] = reserved_range();
  const int span = hi - lo + 1 - (count - 1);
  if (span <= 0) return 0;
  static int next = static_cast<int>(::getpid() * 7919 % span);
  for (int i = 0; i < span; ++i) {
    const int p = lo + (next + i) % span;
    if (!reserve(p)) continue;
    if (count == 2 && !reserve(p + 1)) {
      release(p);
      continue;
    }
    next = (next + i + count) % span;
    return p;
  }
  return 0;
}

}  // namespace

int free_port() {
  const int p = take(1);
  if (p == 0) throw std::runtime_error("free_port: no free port in the test range");
  return p;
}

int free_port_pair() { return take(2); }

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (dir.empty()) continue;
    const std::string p = dir + "/" + name;
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0)
      return p;
  }
  return "";
}

}  // namespace muster::testing

namespace muster::testing {

std::chrono::milliseconds scaled(std::chrono::milliseconds bound) {
  static const double factor = [] {
    const char* v = std::getenv("MUSTER_TEST_TIME_FACTOR");
    if (v == nullptr || *v == '\0') return 1.0;
    char* end = nullptr;
    const double f = std::strtod(v, &end);
    if (end == v || *end != '\0' || !(f >= 1.0) || f > 1000.0) {
      throw std::invalid_argument(std::string("MUSTER_TEST_TIME_FACTOR: expected a number from 1 "
                                              "to 1000, got '") + v + "'");
    }
    return f;
  }();
  return std::chrono::milliseconds(static_cast<std::int64_t>(bound.count() * factor));
}

}  // namespace muster::testing
