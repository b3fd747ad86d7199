#include "muster/agent/supervisor.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

namespace muster::agent {
namespace {

// One message on the pipe: a process group to kill at the end ('T') or no longer ('F'); a
// folder to remove at the end ('D', `value` bytes of path follow).
// One write of at most PIPE_BUF bytes each, so each is atomic.
struct Record {
  char op;
  char pad[3];
  std::int32_t value;
};
static_assert(sizeof(Record) == 8);
constexpr std::size_t kMaxPathBytes = PIPE_BUF - sizeof(Record);

// How long the supervisor waits for a killed cgroup to empty before removing it: processes in
// uninterruptible sleep die only when their I/O ends.
constexpr int kDrainMillis = 10000;

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string unescape_mount_path(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    auto octal = [&](std::size_t k) { return i + k < s.size() && s[i + k] >= '0' && s[i + k] <= '7'; };
    if (s[i] == '\\' && octal(1) && octal(2) && octal(3)) {
      out += static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

// launch's own cgroup v2 folder: the cgroup2 mount (from /proc/self/mountinfo) joined with
// the "0::" path of /proc/self/cgroup, relative to the mount's root. Empty when there is none.
std::string own_cgroup_dir() {
  std::string path;
  {
    std::istringstream in(read_whole_file("/proc/self/cgroup"));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("0::", 0) == 0) path = line.substr(3);
    }
  }
  if (path.empty() || path[0] != '/') return "";
  std::istringstream in(read_whole_file("/proc/self/mountinfo"));
  for (std::string line; std::getline(in, line);) {
    // id parent major:minor root mount-point options [optional...] - fstype source super
    auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream tail(line.substr(dash + 3));
    std::string fstype;
    tail >> fstype;
    if (fstype != "cgroup2") continue;
    std::istringstream head(line.substr(0, dash));
    std::string id, parent, dev, root, mount;
    head >> id >> parent >> dev >> root >> mount;
    root = unescape_mount_path(root);
    mount = unescape_mount_path(mount);
    std::string rel;
    if (root == "/") {
      rel = path;
    } else if (path == root || path.rfind(root + "/", 0) == 0) {
      rel = path.substr(root.size());
    } else {
      continue;  // this mount shows another part of the hierarchy
    }
    if (rel == "/") rel.clear();
    return mount + rel;
  }
  return "";
}

void write_str(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    s.remove_prefix(static_cast<std::size_t>(n));
  }
}

// Kills every process of the cgroup at `dir`, waits (bounded) until it is empty, removes it.
void kill_cgroup_and_remove(const std::string& dir) {
  const int events = ::open((dir + "/cgroup.events").c_str(), O_RDONLY | O_CLOEXEC);
  const int kill_fd = ::open((dir + "/cgroup.kill").c_str(), O_WRONLY | O_CLOEXEC);
  if (kill_fd >= 0) {
    write_str(kill_fd, "1");
    ::close(kill_fd);
  }
  if (events >= 0) {
    // cgroup.events is an event file: poll reports POLLPRI when it changes.
    struct timespec start {};
    ::clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
      char buf[256];
      ssize_t n = ::pread(events, buf, sizeof buf - 1, 0);
      if (n <= 0) break;
      buf[n] = '\0';
      if (std::strstr(buf, "populated 0") != nullptr) break;
      struct timespec now {};
      ::clock_gettime(CLOCK_MONOTONIC, &now);
      const long spent = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
      if (spent >= kDrainMillis) break;
      pollfd p{events, POLLPRI, 0};
      ::poll(&p, 1, static_cast<int>(kDrainMillis - spent));
    }
    ::close(events);
  }
  ::rmdir(dir.c_str());
}

// The supervisor process: never returns.
[[noreturn]] void supervise(int rfd, const std::string& cgroup_dir) {
  // Its own process group: a signal to launch's group (a shell's job control, timeout(1))
  // must not take the supervisor with it.
  ::setpgid(0, 0);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU}) {
    ::signal(sig, SIG_IGN);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::prctl(PR_SET_NAME, "muster-superv");
  // Nothing of launch's stays open here but the pipe: a console or a test's pipe must see
  // EOF when launch exits, and no socket or file may be held past it.
  const int null = ::open("/dev/null", O_RDWR);
  for (int fd = 0; fd <= 2; ++fd) {
    if (null >= 0 && null != fd) ::dup2(null, fd);
  }
  const unsigned lo = 3, hi = static_cast<unsigned>(rfd);
  auto close_range = [](unsigned first, unsigned last) {
    if (first > last) return;
    if (::syscall(SYS_close_range, first, last, 0) == 0) return;
    for (unsigned fd = first; fd <= std::min(last, 65535u); ++fd) ::close(static_cast<int>(fd));
  };
  if (hi > lo) close_range(lo, hi - 1);
  close_range(hi + 1, ~0u);
  if (::chdir("/") != 0) {
    // Keeping launch's folder busy a little longer is harmless.
  }

  std::vector<pid_t> groups;
  std::string folder;
  char buf[2 * PIPE_BUF];
  std::size_t have = 0;
  for (;;) {
    ssize_t n = ::read(rfd, buf + have, sizeof buf - have);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: launch is gone
    have += static_cast<std::size_t>(n);
    std::size_t used = 0;
    while (have - used >= sizeof(Record)) {
      Record r;
      std::memcpy(&r, buf + used, sizeof r);
      const std::size_t text =
          r.op == 'D' ? std::min<std::size_t>(static_cast<std::size_t>(std::max(0, r.value)), kMaxPathBytes) : 0;
      if (have - used < sizeof(Record) + text) break;  // the rest of the path is on its way
      if (r.op == 'T') {
        groups.push_back(r.value);
      } else if (r.op == 'F') {
        groups.erase(std::remove(groups.begin(), groups.end(), r.value), groups.end());
      } else if (r.op == 'D') {
        folder.assign(buf + used + sizeof(Record), text);
      }
      used += sizeof(Record) + text;
    }
    std::memmove(buf, buf + used, have - used);
    have -= used;
  }
  for (pid_t g : groups) {
    if (g > 1) ::kill(-g, SIGKILL);
  }
  if (!cgroup_dir.empty()) kill_cgroup_and_remove(cgroup_dir);
  if (!folder.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(folder, ec);
  }
  ::_exit(0);
}

}  // namespace

std::unique_ptr<JobSupervisor> JobSupervisor::start(bool allow_cgroup) {
  std::unique_ptr<JobSupervisor> s(new JobSupervisor());
  if (allow_cgroup) {
    const std::string own = own_cgroup_dir();
    if (!own.empty() && ::access(own.c_str(), W_OK) == 0) {
      const std::string dir = own + "/muster-" + std::to_string(::getpid());
      bool made = ::mkdir(dir.c_str(), 0755) == 0;
      if (!made && errno == EEXIST && ::rmdir(dir.c_str()) == 0) {
        made = ::mkdir(dir.c_str(), 0755) == 0;  // an empty leftover of an earlier pid
      }
      if (made) {
        s->procs_fd_ = ::open((dir + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
        s->kill_fd_ = ::open((dir + "/cgroup.kill").c_str(), O_WRONLY | O_CLOEXEC);
        if (s->procs_fd_ >= 0 && s->kill_fd_ >= 0) {
          s->cgroup_dir_ = dir;
        } else {  // cgroup.kill needs Linux 5.14: without it, the process-group fallback
          for (int* fd : {&s->procs_fd_, &s->kill_fd_}) {
            if (*fd >= 0) ::close(*fd);
            *fd = -1;
          }
          ::rmdir(dir.c_str());
        }
      }
    }
  }
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    s->finish(std::chrono::milliseconds(0));
    return nullptr;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(p[0]);
    ::close(p[1]);
    s->finish(std::chrono::milliseconds(0));
    return nullptr;
  }
  if (pid == 0) {
    ::close(p[1]);
    supervise(p[0], s->cgroup_dir_);
  }
  ::close(p[0]);
  s->pid_ = pid;
  s->pipe_fd_ = p[1];
  // Never block launch on a supervisor that stopped reading (a record is then lost, which
  // only matters for the process-group fallback).
  ::fcntl(s->pipe_fd_, F_SETFL, O_NONBLOCK);
  return s;
}

JobSupervisor::~JobSupervisor() { finish(std::chrono::milliseconds(0)); }

std::string JobSupervisor::mechanism() const {
  return cgroup_dir_.empty() ? "process groups" : "cgroup " + cgroup_dir_;
}

void JobSupervisor::send(char op, pid_t value, const std::string& text) {
  if (pipe_fd_ < 0 || text.size() > kMaxPathBytes) return;
  Record r{};
  r.op = op;
  r.value = static_cast<std::int32_t>(value);
  std::string msg(reinterpret_cast<const char*>(&r), sizeof r);
  msg += text;
  ssize_t n;
  do {
    n = ::write(pipe_fd_, msg.data(), msg.size());
  } while (n < 0 && errno == EINTR);
}

void JobSupervisor::track_group(pid_t pgid) { send('T', pgid); }

void JobSupervisor::forget_group(pid_t pgid) { send('F', pgid); }

void JobSupervisor::track_folder(const std::string& path) {
  send('D', static_cast<pid_t>(path.size()), path);
}

void JobSupervisor::forget_folder() { send('D', 0); }  // an empty path: nothing to remove


void JobSupervisor::kill_cgroup() {
  if (kill_fd_ >= 0) write_str(kill_fd_, "1");
}

void JobSupervisor::finish(std::chrono::milliseconds wait) {
  if (pipe_fd_ >= 0) {
    ::close(pipe_fd_);
    pipe_fd_ = -1;
  }
  if (pid_ > 0) {
    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(wait.count()));
      ::close(pidfd);
    }
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) pid_ = -1;
    // Otherwise it finishes by itself, a child of whoever adopts it.
  }
  for (int* fd : {&procs_fd_, &kill_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
  if (!cgroup_dir_.empty()) {
    ::rmdir(cgroup_dir_.c_str());  // ENOENT: the supervisor did; EBUSY: it still will
    cgroup_dir_.clear();
  }
}

}  // namespace muster::agent
