#include "proc.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

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

TempDir::TempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string t = std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/muster_test_XXXXXX";
  if (::mkdtemp(t.data()) == nullptr) throw std::runtime_error("mkdtemp");
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

int count_lines_with(const std::string& text, const std::string& needle) {
  int n = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.find(needle) != std::string::npos) ++n;
  }
  return n;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

int free_port_pair() {
  auto can_bind = [](int port) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
  };
  for (int i = 0; i < 100; ++i) {
    const int p = free_port();
    if (p < 65535 && can_bind(p + 1)) return p;
  }
  return 0;
}

}  // namespace muster::testing
