#include "muster/agent/worker_group.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "muster/agent/failure.h"
#include "muster/agent/line_splitter.h"
#include "muster/agent/proc_state.h"
#include "muster/agent/process.h"
#include "muster/rendezvous/limits.h"
#include "muster/ops/control_channel.h"
#include "muster/ops/progress_page.h"
#include "muster/ops/worker_env_names.h"
#include "worker_group_parts.h"

namespace muster::agent {

namespace worker_group_internal {

std::int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void bind_cpus(pid_t pid, const std::set<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  }
  std::error_code ec;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    const pid_t tid = static_cast<pid_t>(std::atoi(task.path().filename().c_str()));
    if (tid > 0 && ::sched_setaffinity(tid, sizeof set, &set) != 0) {
      spdlog::warn("--numa_binding: cannot bind thread {} of pid {}: {}", tid, pid,
                   std::strerror(errno));
    }
  }
}

void set_nice(pid_t pid, int value) {
  std::error_code ec;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    const id_t tid = static_cast<id_t>(std::atoi(task.path().filename().c_str()));
    if (tid > 0) ::setpriority(PRIO_PROCESS, tid, value);
  }
}

int open_log(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) spdlog::error("cannot write {}: {}", path, std::strerror(errno));
  return fd;
}

}  // namespace worker_group_internal

namespace asio = boost::asio;
namespace limits = muster::rendezvous::limits;
using namespace worker_group_internal;

void WorkerGroup::OwnedFd::reset() {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

WorkerGroup::WorkerGroup(asio::io_context& io, const AgentOptions& options, Callbacks callbacks)
    : io_(io), opts_(options), cb_(std::move(callbacks)), timers_(std::make_unique<Timers>(io)) {}

WorkerGroup::~WorkerGroup() = default;

// --- start ---------------------------------------------------------------------------------

WorkerGroup::Started WorkerGroup::start(const v1::Assignment& a, const WorkerEnvSpec& round) {
  release();
  group_rank_ = a.group_rank();
  stopping_ = false;
  open_filtered_logs((std::filesystem::path(opts_.error_dir) /
                      ("attempt_" + std::to_string(a.restart_count())))
                         .string());
  // The run uses progress pages: a hang timeout, or a budget that knows progress.
  const bool watch_progress = a.hang_timeout_ms() > 0 || a.wants_progress();
  for (int lr = 0; lr < opts_.nproc_per_node; ++lr) {
    if (take_spare(lr, a, round, watch_progress)) continue;
    if (auto f = spawn_one(lr, a, round, watch_progress)) return {size(), std::move(f)};
  }
  std::sort(workers_.begin(), workers_.end(),
            [](const auto& x, const auto& y) { return x->local_rank < y->local_rank; });
  watch_round(a, watch_progress);
  spare_round_ = a;
  spare_spec_ = round;
  top_up_spares();
  return {size(), std::nullopt};
}

// The progress pages of the round's workers, sampled by the hang watch.
void WorkerGroup::watch_round(const v1::Assignment& a, bool watch_progress) {
  if (!watch_progress) return;
  std::vector<HangWatch::Watched> watched;
  for (const auto& w : workers_) {
    if (!w->page.empty() && !w->reaped) watched.push_back({w->rank, w->local_rank, w->pid, w->page});
  }
  // The run's rule (the first node's --hang_timeout, or rdzvd's): sampled here, applied by
  // the server over every node's ranks.
  auto timeout = a.hang_timeout_ms() > 0 ? std::chrono::milliseconds(a.hang_timeout_ms())
                                         : kProgressOnlySampling;
  // The straggler watch scores windows of a few steps: pages sampled every
  // kStragglerSampling at least (the watch samples every quarter of `timeout`).
  if (a.watch_stragglers()) timeout = std::min(timeout, 4 * rendezvous::limits::kStragglerSampling);
  if (!hang_watch_ || hang_timeout_ != timeout) {
    hang_timeout_ = timeout;
    hang_watch_ = std::make_unique<HangWatch>(io_, timeout, cb_.progress);
  }
  hang_watch_->start_round(watched);
}

std::map<std::string, std::string> WorkerGroup::worker_env(int lr, const v1::Assignment& a,
                                                           const WorkerEnvSpec& round,
                                                           bool watch_progress, Worker& w) {
  const std::filesystem::path attempt =
      std::filesystem::path(opts_.error_dir) / ("attempt_" + std::to_string(a.restart_count()));
  const std::filesystem::path dir = attempt / std::to_string(lr);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  w.error_file = (dir / "error.json").string();
  WorkerEnvSpec spec = round;
  spec.local_rank = lr;
  spec.error_file = w.error_file;
  std::map<std::string, std::string> env = build_worker_env(opts_.base_env, spec);
  if (watch_progress) {
    if (absl::Status s = HangWatch::create_page((dir / "progress").string()); s.ok()) {
      w.page = (dir / "progress").string();
      env[worker::kProgressFileVar] = w.page;
    } else {
      spdlog::warn("--hang_timeout: {}; rank {} is not watched", std::string(s.message()),
                   w.rank);
    }
    // A Python worker's tracebacks on SIGABRT, for its stack file (docs/hangs.md).
    // The automatic reports of an unmodified PyTorch script: for the hang rule, and for the
    // straggler watch's time per phase (docs/stragglers.md).
    if (!opts_.python_interpreter.empty() && (a.hang_timeout_ms() > 0 || a.watch_stragglers())) {
      if (a.hang_timeout_ms() > 0) env.emplace("PYTHONFAULTHANDLER", "1");
      if (!opts_.python_progress_hook.empty()) {
        std::string& path = env["PYTHONPATH"];
        path = path.empty() ? opts_.python_progress_hook
                            : absl::StrCat(opts_.python_progress_hook, ":", path);
      }
    }
  }
  // A Python worker finds muster_inplace on its PYTHONPATH (after what it had: its own copy
  // wins).
  if (opts_.in_place && !opts_.python_interpreter.empty() && !opts_.python_dir.empty()) {
    std::string& path = env["PYTHONPATH"];
    path = path.empty() ? opts_.python_dir : absl::StrCat(path, ":", opts_.python_dir);
  }
  return env;
}

std::optional<v1::WorkerFailure> WorkerGroup::spawn_one(int lr, const v1::Assignment& a,
                                                        const WorkerEnvSpec& round,
                                                        bool watch_progress, bool spare) {
  const std::string tmpl =
      opts_.prefix_template.empty() ? std::string(kDefaultPrefixTemplate) : opts_.prefix_template;
  auto w = std::make_unique<Worker>();
  w->local_rank = lr;
  w->rank = a.rank_offset() + lr;
  std::map<std::string, std::string> env = worker_env(lr, a, round, watch_progress && !spare, *w);
  std::filesystem::path dir = std::filesystem::path(w->error_file).parent_path();
  std::string prefix = expand_prefix_template(tmpl, opts_.role, w->rank, lr);
  if (spare) {
    // No rank yet: what names one goes, the rest is local rank 0's (the `take` corrects it).
    w->spare = true;
    w->local_rank = w->rank = -1;
    w->error_file.clear();
    for (const char* name : {env::kRank, env::kLocalRank, env::kGroupRank, env::kRoleRank,
                             env::kErrorFile}) {
      env.erase(name);
    }
    env[env::kSpare] = "1";
    const int n = spares_made_++;
    dir = dir.parent_path() / ("spare_" + std::to_string(n));
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    prefix = "[spare" + std::to_string(n) + "]:";
  }
  std::vector<std::string> argv = opts_.argv;
  for (std::size_t i = 1; i < argv.size(); ++i) argv[i] = substitute_local_rank(argv[i], lr);
  SpawnRequest req;
  req.path = opts_.program_path;
  req.argv = std::move(argv);
  // --in_place: a control channel (ops/control_channel.h); the child keeps its end.
  OwnedFd child_end;
  int agent_end = -1;
  if (opts_.in_place) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0) {
      agent_end = sv[0];
      child_end.fd = sv[1];
      env[env::kControlFd] = std::to_string(sv[1]);
      req.control_fd = sv[1];
    } else {
      spdlog::warn("--in_place: no control channel for local rank {}: {}", lr,
                   std::strerror(errno));
      if (spare) return std::nullopt;  // a spare nobody could hand a rank to
    }
  }
  req.envp = to_envp(env);
  if (spare) w->env = std::move(env);
  if (opts_.workers_stdin_null) req.stdin_mode = SpawnRequest::Stdin::kNull;
  req.cgroup_procs_fd = opts_.supervisor != nullptr ? opts_.supervisor->cgroup_procs_fd() : -1;
  if (!spare && lr < static_cast<int>(opts_.numa_of.size())) {
    req.cpus.assign(opts_.numa_of[lr].cpus.begin(), opts_.numa_of[lr].cpus.end());
    req.memory_node = opts_.numa_of[lr].memory_node;
  }
  absl::StatusOr<ChildProcess> child = spawn_worker(req);
  child_end.reset();
  if (!child.ok()) {
    if (agent_end >= 0) ::close(agent_end);
    if (spare) {
      spdlog::warn("--spares: cannot start a spare: {}", std::string(child.status().message()));
      return std::nullopt;
    }
    spdlog::error("cannot start worker local rank {}: {}", lr,
                  std::string(child.status().message()));
    v1::WorkerFailure f = describe(*w);
    f.set_exit_code(127);
    f.set_message(std::string(child.status().message()));
    workers_.push_back(std::move(w));
    return f;
  }
  w->pid = child->pid;
  if (opts_.supervisor != nullptr) opts_.supervisor->track_group(child->pid);
  // A spare's start (an interpreter, the program's imports) yields the CPU to the training
  // workers (a newcomer's warm-up too: the run it joins is training); only where the agent
  // may make it urgent again at its take (root).
  if (spare && ::geteuid() == 0 &&
      ::setpriority(PRIO_PROCESS, static_cast<id_t>(w->pid), limits::kSpareNice) == 0) {
    w->niced = true;
  }
  w->out = make_pipe(child->out_fd, prefix, lr, 1, opts_.stdout_fd, (dir / "stdout.log").string());
  w->err = make_pipe(child->err_fd, prefix, lr, 2, opts_.stderr_fd, (dir / "stderr.log").string());
  w->out->filtered = filtered_[0].fd;
  w->out->filters = &opts_.duplicate_stdout_filters;
  w->err->filtered = filtered_[1].fd;
  w->err->filters = &opts_.duplicate_stderr_filters;
  w->err->keep_tail = !opts_.python_interpreter.empty();
  w->pidfd = std::make_unique<Descriptor>(io_, child->pidfd);
  if (agent_end >= 0) w->control = std::make_unique<Descriptor>(io_, agent_end);
  Worker* raw = w.get();
  (spare ? spares_ : workers_).push_back(std::move(w));
  read_pipe(raw, raw->out.get());
  read_pipe(raw, raw->err.get());
  if (raw->control) read_control(raw);
  watch_exit(raw);
  return std::nullopt;
}


std::unique_ptr<WorkerGroup::Pipe> WorkerGroup::make_pipe(int fd, const std::string& prefix, int lr,
                                                          int bit, int console,
                                                          const std::string& log) {
  auto at = [lr](const auto& v, auto fallback) {
    return lr < static_cast<int>(v.size()) ? v[lr] : fallback;
  };
  const bool redirect = at(opts_.redirect_of, 0) & bit;
  const bool to_file = redirect || (at(opts_.tee_of, 0) & bit);
  const bool shown = !redirect && at(opts_.console_of, true);
  const int file = to_file ? open_log(log) : -1;
  return std::make_unique<Pipe>(io_, fd, prefix, shown ? console : -1, file);
}

// One filtered_std{out,err}.log per attempt, for the streams that have filters.
void WorkerGroup::open_filtered_logs(const std::string& attempt_dir) {
  const std::vector<std::string>* filters[2] = {&opts_.duplicate_stdout_filters,
                                                &opts_.duplicate_stderr_filters};
  const char* names[2] = {"filtered_stdout.log", "filtered_stderr.log"};
  for (int i = 0; i < 2; ++i) {
    filtered_[i].reset();
    if (filters[i]->empty()) continue;
    std::error_code ec;
    std::filesystem::create_directories(attempt_dir, ec);
    filtered_[i].fd = open_log((std::filesystem::path(attempt_dir) / names[i]).string());
  }
}

// --- output --------------------------------------------------------------------------------

namespace {

// The whole prefixed lines in `lines` whose text (after `skip` bytes of prefix) contains one
// of `filters`, to `fd`.
void write_filtered(int fd, const std::vector<std::string>* filters, std::size_t skip,
                    std::string_view lines) {
  if (fd < 0 || filters == nullptr) return;
  std::string matched;
  while (!lines.empty()) {
    const std::size_t nl = lines.find('\n');
    const std::size_t len = nl == std::string_view::npos ? lines.size() : nl + 1;
    std::string_view line = lines.substr(0, len);
    std::string_view text = line.substr(std::min(skip, line.size()));
    if (!text.empty() && text.back() == '\n') text.remove_suffix(1);
    for (const std::string& f : *filters) {
      if (text.find(f) != std::string_view::npos) {
        matched.append(line);
        break;
      }
    }
    lines.remove_prefix(len);
  }
  if (!matched.empty()) write_all(fd, matched);
}

}  // namespace

void WorkerGroup::read_pipe(Worker* w, Pipe* p) {
  p->sd.async_read_some(
      asio::buffer(p->buf), [this, w, p](const boost::system::error_code& ec, std::size_t n) {
        if (ec == asio::error::operation_aborted && ended_) return;
        p->out.clear();
        const std::size_t skip = p->splitter.prefix().size();
        if (!ec) {
          const std::string_view data(p->buf.data(), n);
          if (p->keep_tail) {
            p->tail.append(data);
            if (p->tail.size() > Pipe::kTailBytes) p->tail.erase(0, p->tail.size() - Pipe::kTailBytes);
          }
          if (p->file >= 0) write_all(p->file, data);
          if (p->capture >= 0) write_all(p->capture, data);
          if (p->console >= 0) {
            p->splitter.feed(data, p->out);
            write_all(p->console, p->out);
            write_filtered(p->filtered, p->filters, skip, p->out);
          }
          read_pipe(w, p);
          return;
        }
        if (p->console >= 0) {
          p->splitter.finish(p->out);  // EOF or forced close: flush the partial line
          write_all(p->console, p->out);
          write_filtered(p->filtered, p->filters, skip, p->out);
        }
        boost::system::error_code ignored;
        p->sd.close(ignored);
        if (hang_ && hang_->worker == w && p == w->err.get()) finish_hang();  // tracebacks in
        if (!w->spare) check_gone();  // last: it may release the group (and this pipe)
      });
}

// --- exits ---------------------------------------------------------------------------------

void WorkerGroup::watch_exit(Worker* w) {
  w->pidfd->async_wait(Descriptor::wait_read, [this, w](const boost::system::error_code& ec) {
    if (ec) return;
    int status = 0;
    const pid_t r = ::waitpid(w->pid, &status, WNOHANG);
    if (r == 0) {
      watch_exit(w);
      return;
    }
    w->reaped = true;
    w->pidfd->close();
    if (w->spare) {
      on_spare_exit(*w, status);
      return;
    }
    if (w->released) {
      // Left behind in an earlier round; what is left of its group goes with it, and its
      // group id may now be reused.
      spdlog::info("worker rank {} (pid {}), left behind stuck in the kernel, has exited", w->rank,
                   w->pid);
      ::kill(-w->pid, SIGKILL);
      if (opts_.supervisor != nullptr) opts_.supervisor->forget_group(w->pid);
      return;
    }
    on_exit(*w, status);
  });
}

v1::WorkerFailure WorkerGroup::describe(const Worker& w) const {
  v1::WorkerFailure f;
  f.set_host(opts_.host);
  f.set_rank(w.rank);
  f.set_local_rank(w.local_rank);
  f.set_group_rank(group_rank_);
  f.set_pid(w.pid);
  f.set_timestamp_ms(wall_ms());
  f.set_error_file(w.error_file);
  return f;
}

void WorkerGroup::on_exit(Worker& w, int status) {
  if (file_timers_ != nullptr) file_timers_->clear(w.pid);
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  const bool being_dumped = hang_ && hang_->worker == &w && !hang_->reported;
  if (!ok && !being_dumped && !stopping_) {
    v1::WorkerFailure f = describe(w);
    if (WIFSIGNALED(status)) {
      f.set_signal(WTERMSIG(status));
    } else {
      f.set_exit_code(WEXITSTATUS(status));
    }
    read_error_file(w.error_file, f);
    if (!w.timer_scope.empty() && f.message().empty()) {
      f.set_message("killed by the file-timer watchdog: timer '" + w.timer_scope + "' expired");
    }
    cb_.failed(f);
  }
  if (all_reaped()) {
    // Whatever is left in the workers' process groups (and, with a job cgroup, whatever they
    // started anywhere) must not outlive them. The job cgroup holds the node's spares too: while
    // one lives (it may be about to take a dead worker's rank, --spares), the cgroup is left
    // alone, and what a worker started outside its process group goes when the job ends.
    signal_groups(SIGKILL);
    if (opts_.supervisor != nullptr && live_spares() == 0) opts_.supervisor->kill_cgroup();
    arm_drain_timer();
  }
  check_gone();  // last: it may release the group (and this worker)
}

bool WorkerGroup::all_reaped() const {
  for (const auto& w : workers_) {
    if (w->pid > 0 && !w->reaped && !w->abandoned) return false;
  }
  return true;
}

bool WorkerGroup::gone() const {
  if (!all_reaped()) return false;
  for (const auto& w : workers_) {
    if ((w->out && w->out->sd.is_open()) || (w->err && w->err->sd.is_open())) return false;
  }
  return true;
}

void WorkerGroup::check_gone() {
  if (!gone()) return;
  timers_->cancel();
  cb_.changed();
}


// --- stop ----------------------------------------------------------------------------------

void WorkerGroup::signal_groups(int sig) {
  for (const auto& w : workers_) {
    if (w->pid > 0) ::kill(-w->pid, sig);
  }
}

void WorkerGroup::stop(int sig) {
  if (hang_watch_) hang_watch_->stop();
  const bool first = !stopping_;
  stopping_ = true;
  kill_spares();
  if (workers_.empty()) return;
  if (!all_reaped()) signal_groups(sig);
  if (first) {
    timers_->grace.expires_after(opts_.shutdown_timeout);
    timers_->grace.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      if (!all_reaped()) {
        spdlog::warn("workers still running after the {} ms grace; killing them",
                     opts_.shutdown_timeout.count());
      }
      signal_groups(SIGKILL);
      if (all_reaped() && opts_.supervisor != nullptr) opts_.supervisor->kill_cgroup();
      arm_drain_timer();
      if (!all_reaped()) arm_unkillable_timer();
    });
  }
  if (gone()) timers_->cancel();
}

void WorkerGroup::kill_now() {
  signal_groups(SIGKILL);
  if (!all_reaped()) arm_unkillable_timer();
}

// Drops the (reaped, killed) workers; their group ids may now be reused, so the supervisor
// must no longer kill them. A worker left behind in the kernel is kept (abandoned_), its pidfd
// watched and its group still the supervisor's, until it is reaped.
void WorkerGroup::release() {
  timers_->cancel();
  timers_->hang.cancel();
  stack_dump_.reset();
  hang_.reset();
  for (auto& w : workers_) {
    if (w->abandoned && !w->reaped) {
      w->released = true;
      abandoned_.push_back(std::move(w));
      continue;
    }
    if (w->pid > 0 && opts_.supervisor != nullptr) opts_.supervisor->forget_group(w->pid);
  }
  workers_.clear();
}

// SIGKILL has been sent: a worker still not reaped after limits::kUnkillableWait whose state
// is D is left behind (proc_state.h); the others are looked at again after as long.
void WorkerGroup::arm_unkillable_timer() {
  timers_->unkillable.expires_after(limits::kUnkillableWait);
  timers_->unkillable.async_wait([this](const boost::system::error_code& ec) {
    if (ec || !stopping_ || all_reaped()) return;
    leave_stuck_workers();
  });
}

void WorkerGroup::leave_stuck_workers() {
  std::vector<Worker*> unreaped;
  std::vector<std::optional<ProcState>> states;
  for (const auto& w : workers_) {
    if (w->pid > 0 && !w->reaped && !w->abandoned) {
      unreaped.push_back(w.get());
      states.push_back(read_proc_state(w->pid));
    }
  }
  for (std::size_t i : workers_to_abandon(states)) {
    Worker& w = *unreaped[i];
    w.abandoned = true;
    w.stuck = *states[i];
    spdlog::warn("{}", stuck_worker_message(w.rank, w.pid, w.stuck, kernel_stacks(w.pid),
                                            kStuckStackLines));
    cancel_pipes(w);
  }
  if (!all_reaped()) {
    arm_unkillable_timer();
    return;
  }
  if (opts_.supervisor != nullptr) opts_.supervisor->kill_cgroup();
  arm_drain_timer();
  check_gone();
}

// Stops reading a worker's output (its read handlers close the pipes).
void WorkerGroup::cancel_pipes(Worker& w) {
  for (Pipe* p : {w.out.get(), w.err.get()}) {
    if (p != nullptr && p->sd.is_open()) p->sd.cancel();
  }
}

void WorkerGroup::arm_drain_timer() {
  timers_->drain.expires_after(kPipeDrainLimit);
  timers_->drain.async_wait([this](const boost::system::error_code& ec) {
    if (ec || !all_reaped()) return;
    for (const auto& w : workers_) cancel_pipes(*w);
  });
}

void WorkerGroup::end() {
  ended_ = true;
  warm_done_ = nullptr;
  timers_->warm.cancel();
  kill_spares();
  for (const auto* list : {&workers_, &abandoned_}) {
    for (const auto& w : *list) {
      if (!w->abandoned || w->reaped) continue;
      spdlog::error("worker rank {} (pid {}) is stuck in the kernel (state {}{}{}) and was left "
                    "behind; it may still be there",
                    w->rank, w->pid, w->stuck.state, w->stuck.wchan.empty() ? "" : ", wchan ",
                    w->stuck.wchan);
    }
  }
  timers_->cancel();
  timers_->hang.cancel();
  if (hang_watch_) hang_watch_->stop();
}

}  // namespace muster::agent
