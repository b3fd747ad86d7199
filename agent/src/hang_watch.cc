#include "muster/agent/hang_watch.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "muster/agent/proc_state.h"
#include "muster/ops/progress_page.h"

extern char** environ;

namespace muster::agent {
namespace {

namespace asio = boost::asio;
using worker::kProgressPageBytes;
using worker::ProgressPage;

}  // namespace

HangWatch::HangWatch(asio::io_context& io, std::chrono::milliseconds timeout, Sample on_sample)
    : timeout_(timeout), on_sample_(std::move(on_sample)), timer_(io) {}

HangWatch::~HangWatch() { stop(); }

absl::Status HangWatch::create_page(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("progress page ", path));
  ProgressPage head{};
  head.magic = worker::kProgressMagic;
  head.version = worker::kProgressVersion;
  std::string page(kProgressPageBytes, '\0');
  std::memcpy(page.data(), &head, sizeof head);
  const bool ok = ::write(fd, page.data(), page.size()) == static_cast<ssize_t>(page.size());
  const int e = errno;
  ::close(fd);
  if (!ok) return absl::ErrnoToStatus(e, absl::StrCat("progress page ", path));
  return absl::OkStatus();
}

void HangWatch::start_round(const std::vector<Watched>& workers) {
  stop();
  std::vector<rendezvous::RankProgress> ranks;
  for (const Watched& w : workers) {
    void* map = MAP_FAILED;
    if (const int fd = ::open(w.page.c_str(), O_RDONLY | O_CLOEXEC); fd >= 0) {
      map = ::mmap(nullptr, kProgressPageBytes, PROT_READ, MAP_SHARED, fd, 0);
      ::close(fd);
    }
    if (map == MAP_FAILED) {
      spdlog::warn("--hang_timeout: cannot map {} ({}); rank {} is not watched", w.page,
                   std::strerror(errno), w.rank);
      continue;
    }
    maps_.push_back(map);
    rendezvous::RankProgress r;
    r.rank = w.rank;
    r.local_rank = w.local_rank;
    r.pid = w.pid;
    ranks.push_back(r);
  }
  tracker_.reset(ranks, rendezvous::StallClock::now());
  active_ = true;
  arm();
}

void HangWatch::stop() {
  active_ = false;
  timer_.cancel();
  for (void* m : maps_) ::munmap(m, kProgressPageBytes);
  maps_.clear();
}

void HangWatch::arm() {
  // A quarter of the timeout (at most 1 s, at least 50 ms): a stall is seen within 25% late.
  const auto every = std::clamp(timeout_ / 4, std::chrono::milliseconds(50),
                                std::chrono::milliseconds(1000));
  timer_.expires_after(every);
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || !active_) return;
    check();
  });
}

void HangWatch::check() {
  const auto now = rendezvous::StallClock::now();
  const auto& ranks = tracker_.ranks();
  for (std::size_t i = 0; i < maps_.size() && i < ranks.size(); ++i) {
    worker::ProgressSnapshot s;
    if (worker::read_progress(static_cast<const ProgressPage*>(maps_[i]), &s)) {
      std::vector<std::uint64_t> kinds;
      if (s.kind_since != 0) {  // a writer that keeps phase times
        std::uint64_t totals[worker::kPhaseKinds];
        s.kind_totals(worker::monotonic_ns(), totals);
        kinds.assign(totals, totals + worker::kPhaseKinds);
      }
      tracker_.update(ranks[i].rank, s.reports, s.step, s.phase, now, std::move(kinds));
    }
  }
  on_sample_(tracker_.ranks(), now);
  if (active_) arm();
}

std::string kernel_stacks(pid_t pid) {
  std::string out;
  const std::string base = absl::StrCat("/proc/", pid, "/task");
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(base, ec)) {
    const std::string dir = t.path().string();
    std::string state;
    std::istringstream status(read_proc_file(dir + "/status").value_or(""));
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("State:", 0) == 0) state = line.substr(6);
    }
    absl::StrAppend(&out, "thread ", t.path().filename().string(), " (",
                    read_proc_file(dir + "/comm").value_or(""), ") state:", state,
                    " wchan: ", read_proc_file(dir + "/wchan").value_or(""), "\n");
    const std::string stack = read_proc_file(dir + "/stack").value_or("");
    absl::StrAppend(&out, stack.empty() ? "  (no kernel stack: /proc/PID/stack needs root)\n" : stack,
                    "\n");
  }
  return out;
}

std::unique_ptr<StackDump> StackDump::start(asio::io_context& io, pid_t pid, const std::string& path,
                                            std::chrono::milliseconds budget,
                                            const std::string& gdb,
                                            std::function<void(const std::string&)> done) {
  std::unique_ptr<StackDump> d(new StackDump(io));
  d->done_ = std::move(done);
  d->path_ = path;
  d->target_ = pid;
  // gdb, when there is one: every thread's backtrace with function names.
  if (!gdb.empty()) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
    const std::string pid_text = std::to_string(pid);
    std::vector<std::string> args{gdb,  "-nx", "-batch", "-p", pid_text, "-ex",
                                  "set pagination off", "-ex", "thread apply all bt"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t child = -1;
    const int rc = ::posix_spawn(&child, gdb.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    const int pidfd = rc == 0 ? static_cast<int>(::syscall(SYS_pidfd_open, child, 0)) : -1;
    if (pidfd >= 0) {
      d->gdb_ = child;
      d->what_ = "gdb";
      d->pidfd_ = std::make_unique<asio::posix::stream_descriptor>(io, pidfd);
      StackDump* raw = d.get();
      d->pidfd_->async_wait(asio::posix::stream_descriptor::wait_read,
                            [raw](const boost::system::error_code& ec) {
                              if (!ec) raw->finish();
                            });
      d->timer_.expires_after(budget);
      d->timer_.async_wait([raw](const boost::system::error_code& ec) {
        if (ec) return;
        spdlog::warn("gdb did not finish the stack dump in time; ending it");
        raw->finish();
      });
      return d;
    }
    if (rc == 0) {
      ::kill(child, SIGKILL);
      ::waitpid(child, nullptr, 0);
    }
  }
  // Without gdb: the kernel's view, now (small reads), reported from the loop.
  std::ofstream(path) << "(no gdb on PATH: the kernel's view of each thread)\n" << kernel_stacks(pid);
  d->what_ = "/proc";
  // Reported from the loop, through the timer: a dump destroyed first (its round released)
  // cancels it, where a bare post would call into freed memory.
  StackDump* raw = d.get();
  d->timer_.expires_after(std::chrono::milliseconds(0));
  d->timer_.async_wait([raw](const boost::system::error_code& ec) {
    if (!ec) raw->finish();
  });
  return d;
}

void StackDump::finish() {
  if (finished_) return;
  finished_ = true;
  timer_.cancel();
  if (gdb_ > 0) {
    ::kill(gdb_, SIGKILL);  // a no-op when it has exited; ends it after the budget
    ::waitpid(gdb_, nullptr, 0);
    gdb_ = -1;
    // The kernel's view too: it says where a thread in the kernel (state D) waits.
    std::ofstream(path_, std::ios::app) << "\n--- kernel view ---\n" << kernel_stacks(target_);
  }
  if (pidfd_) pidfd_->close();
  auto done = std::move(done_);
  const std::string what = what_;  // `done` may destroy this dump
  if (done) done(what);
}

StackDump::~StackDump() {
  timer_.cancel();
  if (gdb_ > 0) {
    ::kill(gdb_, SIGKILL);
    ::waitpid(gdb_, nullptr, 0);
  }
}

}  // namespace muster::agent
