#include "sshd.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace muster::testing {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kSshd = "/usr/sbin/sshd";
constexpr const char* kKeygen = "/usr/bin/ssh-keygen";
constexpr auto kReadyDeadline = std::chrono::seconds(15);
constexpr auto kStopBound = std::chrono::seconds(5);

absl::Status write_text(const std::string& path, const std::string& text, mode_t mode) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError("SshHosts: cannot write " + path);
  if (::chmod(path.c_str(), mode) != 0)
    return absl::InternalError("SshHosts: cannot chmod " + path + ": " + std::strerror(errno));
  return absl::OkStatus();
}

std::string lines(const std::vector<std::string>& ls) {
  std::string out;
  for (const auto& l : ls) out += l + "\n";
  return out;
}

// A fresh ed25519 key pair at `path` and `path`.pub (ssh-keygen would ask before overwriting).
absl::Status keygen(const std::string& path, const std::string& comment) {
  std::error_code ec;
  fs::remove(path, ec);
  fs::remove(path + ".pub", ec);
  Proc p({kKeygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path});
  auto code = p.wait(std::chrono::seconds(30));
  if (code != 0) {
    return absl::InternalError("SshHosts: `ssh-keygen -f " + path + "` failed (" +
                               (code ? "exit " + std::to_string(*code) : "timed out") +
                               "): " + trim_end(p.err()));
  }
  return absl::OkStatus();
}

// True once `addr`:22 accepts a connection and sends an SSH banner, within `timeout`.
bool answers_ssh(const std::string& addr, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto left_ms = [&] {
    return static_cast<int>(std::max<long>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  };
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(22);
  if (::inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1) return false;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool ok = false;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 || errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    if (::poll(&p, 1, left_ms()) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
        err == 0) {
      std::string got;
      char buf[256];
      while (got.size() < 4) {
        pollfd r{fd, POLLIN, 0};
        if (::poll(&r, 1, left_ms()) != 1) break;
        ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        got.append(buf, static_cast<std::size_t>(n));
      }
      ok = got.rfind("SSH-", 0) == 0;
    }
  }
  ::close(fd);
  return ok;
}

// Every descendant of `root` alive now (children before grandchildren), from /proc.
std::vector<pid_t> descendants(pid_t root) {
  std::multimap<pid_t, pid_t> children;
  if (DIR* d = ::opendir("/proc")) {
    while (dirent* e = ::readdir(d)) {
      char* end = nullptr;
      long pid = std::strtol(e->d_name, &end, 10);
      if (pid <= 0 || *end != '\0') continue;
      std::string stat = read_file("/proc/" + std::string(e->d_name) + "/stat");
      // "pid (comm) state ppid ...": comm may hold spaces and ')', so parse after the last ')'.
      auto close = stat.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(stat.substr(close + 1));
      std::string state;
      long ppid = 0;
      if (rest >> state >> ppid)
        children.emplace(static_cast<pid_t>(ppid), static_cast<pid_t>(pid));
    }
    ::closedir(d);
  }
  std::vector<pid_t> out;
  std::vector<pid_t> todo{root};
  for (std::size_t i = 0; i < todo.size(); ++i) {
    auto [b, e] = children.equal_range(todo[i]);
    for (auto it = b; it != e; ++it) {
      out.push_back(it->second);
      todo.push_back(it->second);
    }
  }
  return out;
}

std::vector<int> pidfds_of(const std::vector<pid_t>& pids) {
  std::vector<int> fds;
  for (pid_t p : pids) {
    int fd = open_pidfd(p);
    if (fd >= 0) fds.push_back(fd);
  }
  return fds;
}

int pidfd_signal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

// SIGTERM to each, then SIGKILL to those alive after kStopBound; closes the pidfds. They are
// not our children (their parent is sshd, or init once it is gone): nothing to reap.
void end_all(std::vector<int>& pidfds) {
  for (int fd : pidfds) pidfd_signal(fd, SIGTERM);
  const auto deadline = Clock::now() + kStopBound;
  for (int fd : pidfds) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (!wait_pidfd(fd, std::max(left, std::chrono::milliseconds(0)))) {
      pidfd_signal(fd, SIGKILL);
      wait_pidfd(fd, kStopBound);
    }
    ::close(fd);
  }
  pidfds.clear();
}

// Ends the listener, our child: SIGTERM, SIGKILL after kStopBound, reaped by Proc::wait.
void end_listener(Proc& p) {
  ::kill(p.pid(), SIGTERM);
  if (!p.wait(kStopBound)) {
    ::kill(p.pid(), SIGKILL);
    p.wait(kStopBound);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SshHosts>> SshHosts::start(const HostNet& net,
                                                          const std::vector<int>& hosts,
                                                          const std::string& dir) {
  for (const char* tool : {kSshd, kKeygen}) {
    if (::access(tool, X_OK) != 0)
      return absl::FailedPreconditionError(std::string("SshHosts: no ") + tool +
                                           " (Debian's openssh-server / openssh-client)");
  }
  if (hosts.empty()) return absl::InvalidArgumentError("SshHosts: no host given");
  std::set<int> seen;
  for (int h : hosts) {
    if (h < 0 || h >= net.size())
      return absl::OutOfRangeError("SshHosts: HostNet has no host " + std::to_string(h));
    if (!seen.insert(h).second)
      return absl::InvalidArgumentError("SshHosts: host " + std::to_string(h) + " given twice");
  }
  const passwd* pw = ::getpwuid(::geteuid());
  if (pw == nullptr) return absl::FailedPreconditionError("SshHosts: the current user has no name");
  const std::string user = pw->pw_name;

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError("SshHosts: cannot make " + dir + ": " + ec.message());
  // sshd's privilege separation folder (Debian's unit makes it at boot; a container has none).
  if (::mkdir("/run/sshd", 0755) != 0 && errno != EEXIST)
    return absl::InternalError(std::string("SshHosts: cannot make /run/sshd: ") +
                               std::strerror(errno));

  std::unique_ptr<SshHosts> s(new SshHosts());
  s->dir_ = dir;
  s->ssh_config_ = dir + "/ssh_config";
  const std::string client = s->client_key();
  if (auto st = keygen(client, "muster-test-client"); !st.ok()) return st;
  if (auto st = write_text(dir + "/authorized_keys", read_file(client + ".pub"), 0600); !st.ok())
    return st;

  std::string known;
  for (int h : hosts) {
    const std::string key = dir + "/host" + std::to_string(h) + "_key";
    if (auto st = keygen(key, net.hostname(h)); !st.ok()) return st;
    // "ssh-ed25519 AAAA... comment": the comment is not part of a known_hosts entry.
    std::istringstream pub(read_file(key + ".pub"));
    std::string type, blob;
    pub >> type >> blob;
    known += net.hostname(h) + "," + net.addr(h) + " " + type + " " + blob + "\n";
    known += net.hostname(h) + "-v6," + net.addr6(h) + " " + type + " " + blob + "\n";
    const std::string config =
        lines({"Port 22", "ListenAddress 0.0.0.0", "ListenAddress ::", "HostKey " + key,
               "AuthorizedKeysFile " + dir + "/authorized_keys", "PidFile none", "UsePAM no",
               "StrictModes no", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
               "PasswordAuthentication no", "KbdInteractiveAuthentication no", "LogLevel VERBOSE"});
    if (auto st = write_text(dir + "/sshd_config_" + std::to_string(h), config, 0600); !st.ok())
      return st;
  }
  if (auto st = write_text(s->known_hosts(), known, 0600); !st.ok()) return st;
  const std::string client_config =
      lines({"Host *", "  User " + user, "  IdentityFile " + client, "  IdentitiesOnly yes",
             "  IdentityAgent none", "  UserKnownHostsFile " + s->known_hosts(),
             "  GlobalKnownHostsFile /dev/null", "  StrictHostKeyChecking yes", "  BatchMode yes",
             "  ConnectTimeout 5", "  LogLevel ERROR"});
  if (auto st = write_text(s->ssh_config_, client_config, 0600); !st.ok()) return st;

  for (int h : hosts) {
    fs::remove(s->log_path(h), ec);
    // sh execs sshd (the pid stays the listener's) with its stderr on the log file and no
    // pipe of ours: nobody drains a pipe while a test runs ssh, a full one would stall sshd,
    // and sessions would hold it open after the listener is gone.
    s->sshd_[h] = std::make_unique<Proc>(
        net.wrap(h, {"/bin/sh", "-c", "exec \"$@\" </dev/null >/dev/null 2>>\"$0\"", s->log_path(h),
                     kSshd, "-D", "-e", "-f", dir + "/sshd_config_" + std::to_string(h)}));
  }
  // Ready when each answers with its banner; between tries, wait on its exit (an sshd that
  // cannot start exits at once: its log says why).
  const auto deadline = Clock::now() + kReadyDeadline;
  for (int h : hosts) {
    Proc& p = *s->sshd_[h];
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (answers_ssh(net.addr(h), std::min<std::chrono::milliseconds>(
                                       std::max(left, std::chrono::milliseconds(1)), 1s)))
        break;
      std::optional<int> code = p.wait(std::chrono::milliseconds(50));
      if (code || Clock::now() >= deadline) {
        std::string why = code ? "exited with " + std::to_string(*code)
                               : "did not answer on " + net.addr(h) + ":22 within 15 s";
        return absl::UnavailableError("SshHosts: sshd in host " + std::to_string(h) + " " + why +
                                      "; its stderr: " + trim_end(read_file(s->log_path(h))) +
                                      (p.err().empty() ? "" : "; " + trim_end(p.err())));
      }
    }
  }
  return s;  // on an error above, ~SshHosts ends what was started
}

SshHosts::~SshHosts() {
  for (auto& [host, p] : sshd_) {
    if (!p) continue;
    std::vector<int> sessions = pidfds_of(descendants(p->pid()));
    end_listener(*p);
    end_all(sessions);
  }
  end_all(orphans_);
}

std::string SshHosts::log_path(int host) const {
  return dir_ + "/sshd" + std::to_string(host) + ".log";
}

pid_t SshHosts::sshd_pid(int host) const {
  auto it = sshd_.find(host);
  return it == sshd_.end() || !it->second ? -1 : it->second->pid();
}

bool SshHosts::stop(int host) {
  auto it = sshd_.find(host);
  if (it == sshd_.end() || !it->second) return false;
  std::vector<int> sessions = pidfds_of(descendants(it->second->pid()));
  orphans_.insert(orphans_.end(), sessions.begin(), sessions.end());
  end_listener(*it->second);
  it->second.reset();
  return true;
}

}  // namespace muster::testing
