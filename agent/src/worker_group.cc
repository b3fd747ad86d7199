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

namespace muster::agent {
namespace {

namespace asio = boost::asio;
namespace limits = muster::rendezvous::limits;
using Descriptor = asio::posix::stream_descriptor;

// Once every worker is reaped and its group killed, a pipe still open belongs to a process
// that left the group; stop waiting for it after this long.
constexpr auto kPipeDrainLimit = std::chrono::seconds(2);
// Lines of a stuck worker's kernel stack in its warning (the whole view is kernel_stacks').
constexpr int kStuckStackLines = 8;
// Without a hang timeout (only a budget that knows progress), a progress sample every
// quarter of this.
constexpr auto kProgressOnlySampling = std::chrono::milliseconds(4000);

std::int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// --numa_binding for a spare that takes a local rank: every thread it has now (the ones it
// starts later inherit). Its memory stays where it was allocated.
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

// Every thread of `pid` to nice `value` (the ones it starts later inherit from theirs).
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

}  // namespace

// One worker output stream: to the console (whole prefixed lines; -1: not shown) and/or to a
// log file (raw; -1: none).
struct WorkerGroup::Pipe {
  Pipe(asio::io_context& io, int fd, std::string prefix, int console, int file)
      : sd(io, fd), splitter(std::move(prefix)), console(console), file(file) {}
  ~Pipe() {
    if (file >= 0) ::close(file);
  }
  Descriptor sd;
  LineSplitter splitter;
  int console;
  int file;
  // The attempt's filtered_std{out,err}.log (owned by the group) and its filters; -1: none.
  int filtered = -1;
  const std::vector<std::string>* filters = nullptr;
  std::array<char, 64 * 1024> buf;
  std::string out;
  // The stream's last kTailBytes, kept for a Python worker's stderr (the ModuleNotFoundError
  // hint); empty otherwise.
  static constexpr std::size_t kTailBytes = 4096;
  bool keep_tail = false;
  std::string tail;
  // A hung Python worker's stderr while faulthandler dumps its tracebacks: also written here.
  int capture = -1;
};

struct WorkerGroup::Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  std::string error_file;
  std::unique_ptr<Descriptor> pidfd;
  std::unique_ptr<Pipe> out, err;
  bool reaped = false;
  std::string timer_scope;  // the file timer that expired, when the agent killed it for one
  // Stuck in the kernel (state D) after SIGKILL: the group goes on without it (all_reaped
  // counts it), its pidfd is still watched, and its process group stays with the supervisor.
  bool abandoned = false;
  ProcState stuck;
  // Abandoned, and its round is over (it lives in abandoned_); or a replacement still
  // starting that an in-place re-form replaced (it lives in retired_). Its exit is not a
  // failure.
  bool released = false;
  std::string page;       // its progress page ("": none)
  // --in_place: the agent's end of its control channel, and what the worker said on it.
  std::unique_ptr<Descriptor> control;
  std::array<char, ops::control::kMaxMessageBytes + 1> control_buf;
  // --spares: a spare (no rank yet), ready once it said `hello spare=1`; its environment.
  bool spare = false;
  bool spare_ready = false;
  bool niced = false;  // started at limits::kSpareNice (the agent can give that back)
  std::map<std::string, std::string> env;
};

// A stalled worker being dumped (--hang_timeout): reported once its stacks are written.
struct WorkerGroup::Hang {
  Worker* worker = nullptr;
  std::string what;  // Stall::describe
  std::string stack_file;
  bool reported = false;
};

struct WorkerGroup::Timers {
  explicit Timers(asio::io_context& io)
      : grace(io), drain(io), unkillable(io), hang(io), warm(io) {}
  void cancel() {
    grace.cancel();
    drain.cancel();
    unkillable.cancel();
  }
  asio::steady_timer grace;       // SIGKILL after the shutdown grace
  asio::steady_timer drain;       // pipes held open by a process that left the group
  asio::steady_timer unkillable;  // after SIGKILL: for workers stuck in the kernel
  asio::steady_timer hang;        // a Python worker's faulthandler dump
  asio::steady_timer warm;        // --spares: the first workers' warm-up (not in cancel())
};

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

// --- in place (docs/in_place.md) ----------------------------------------------------------

void WorkerGroup::read_control(Worker* w) {
  w->control->async_read_some(
      asio::buffer(w->control_buf), [this, w](const boost::system::error_code& ec, std::size_t n) {
        if (ec) {
          if (ec != asio::error::operation_aborted && w->control) {
            boost::system::error_code ignored;
            w->control->close(ignored);
          }
          return;
        }
        auto m = ops::control::parse(std::string_view(w->control_buf.data(), n));
        if (!m) {
          spdlog::warn("control channel: worker rank {} (pid {}) sent a malformed message; "
                       "ignored",
                       w->rank, w->pid);
        } else if (m->kind == ops::control::kHello && m->text("spare") == "1") {
          if (w->spare) {
            w->spare_ready = true;
            spare_capable_ = true;
            spdlog::info("--spares: spare pid {} is ready", w->pid);
            if (warm_done_ && ready_spares() >= opts_.nproc_per_node) warm_done("");
          } else if (!spare_capable_) {
            spare_capable_ = true;  // the program can wait as a spare: keep some
            top_up_spares();
          }
        } else if (w->spare) {
          // A spare says nothing else before it is taken.
        } else if (m->kind == ops::control::kHello && m->text("in_place") == "1") {
          if (cb_.declared) cb_.declared(w->local_rank);
        } else if (m->kind == ops::control::kResumed) {
          const auto round = m->number("round");
          if (cb_.resumed) cb_.resumed(w->local_rank, round ? static_cast<int>(*round) : -1);
        }
        read_control(w);  // last: a callback may have reformed the group, never released it
      });
}

void WorkerGroup::send_control(Worker& w, const std::string& packet) {
  if (!w.control || !w.control->is_open() || w.reaped) return;
  if (::send(w.control->native_handle(), packet.data(), packet.size(),
             MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
    spdlog::warn("control channel: cannot write to worker rank {} (pid {}): {}", w.rank, w.pid,
                 std::strerror(errno));
  }
}

void WorkerGroup::abort_all(int round) {
  const std::string packet =
      ops::control::encode({ops::control::kAbort, {{"round", std::to_string(round)}}});
  for (const auto& w : workers_) send_control(*w, packet);
}

WorkerGroup::Started WorkerGroup::reform(const v1::Assignment& a, const WorkerEnvSpec& round,
                                         const std::vector<int>& lost_ranks,
                                         const std::vector<int>& replace) {
  std::string lost;
  for (int r : lost_ranks) lost += (lost.empty() ? "" : ",") + std::to_string(r);
  // Workers retired by earlier re-forms whose pipes and channel have closed have no handler
  // left to run: they go (a long job recovers many times).
  auto drained = [](const std::unique_ptr<Worker>& w) {
    if (!w->reaped) return false;  // a replaced one still exiting: its exit is still watched
    for (const Descriptor* d : {w->out ? &w->out->sd : nullptr, w->err ? &w->err->sd : nullptr,
                                w->control.get()}) {
      if (d != nullptr && d->is_open()) return false;
    }
    return true;
  };
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(), drained), retired_.end());
  group_rank_ = a.group_rank();
  const bool watch_progress = a.hang_timeout_ms() > 0 || a.wants_progress();
  std::vector<int> dead;
  for (auto it = workers_.begin(); it != workers_.end();) {
    Worker& w = **it;
    const bool replaced =
        std::find(replace.begin(), replace.end(), w.local_rank) != replace.end();
    if (!w.reaped && !replaced) {
      w.rank = a.rank_offset() + w.local_rank;
      ops::control::Message m{ops::control::kWorld, {}};
      auto& f = m.fields;
      f["round"] = std::to_string(a.round());
      f["rank"] = std::to_string(w.rank);
      f["world_size"] = std::to_string(round.world_size);
      f["local_rank"] = std::to_string(w.local_rank);
      f["local_world_size"] = std::to_string(round.local_world_size);
      f["group_rank"] = std::to_string(round.group_rank);
      f["group_world_size"] = std::to_string(round.group_world_size);
      f["restart_count"] = std::to_string(round.restart_count);
      f["master_addr"] = round.master_addr;
      f["master_port"] = std::to_string(round.master_port);
      if (!lost.empty()) f["lost"] = lost;
      send_control(w, ops::control::encode(m));
      ++it;
      continue;
    }
    // Dead (or a replacement still starting, which holds nothing): its process group goes; a
    // new process takes its local rank. A live one's exit is then not a failure (released).
    ::kill(-w.pid, SIGKILL);
    if (w.reaped) {
      if (opts_.supervisor != nullptr) opts_.supervisor->forget_group(w.pid);
    } else {
      w.released = true;  // its exit is not a failure
      if (w.control) {    // nor is anything it still says (a late hello is not the new one's)
        boost::system::error_code ignored;
        w.control->close(ignored);
      }
    }
    dead.push_back(w.local_rank);
    retired_.push_back(std::move(*it));
    it = workers_.erase(it);
  }
  spare_round_ = a;
  spare_spec_ = round;
  for (int lr : dead) {
    if (take_spare(lr, a, round, watch_progress)) continue;
    if (auto f = spawn_one(lr, a, round, watch_progress)) return {size(), std::move(f)};
    spdlog::info("in place: local rank {} (rank {}) starts in a new process (pid {})", lr,
                 workers_.back()->rank, workers_.back()->pid);
  }
  top_up_spares();
  std::sort(workers_.begin(), workers_.end(),
            [](const auto& x, const auto& y) { return x->local_rank < y->local_rank; });
  watch_round(a, watch_progress);
  return {static_cast<int>(dead.size()), std::nullopt};
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

// --- spares (--spares; docs/in_place_torch.md, "Warm spares") -----------------------------

int WorkerGroup::ready_spares() const {
  int n = 0;
  for (const auto& s : spares_) n += s->spare_ready && !s->reaped;
  return n;
}

int WorkerGroup::live_spares() const {
  int n = 0;
  for (const auto& s : spares_) n += s->pid > 0 && !s->reaped;
  return n;
}

void WorkerGroup::top_up_spares() {
  if (!spare_capable_ || opts_.spares <= 0 || stopping_ || ended_ || !spare_round_ ||
      all_reaped()) {
    return;
  }
  if (spare_failures_ >= limits::kMaxSpareFailures) return;
  for (std::size_t i = 1; i < opts_.argv.size(); ++i) {
    if (substitute_local_rank(opts_.argv[i], 0) != opts_.argv[i]) {
      spdlog::warn("--spares: the program's arguments name the local rank; no spares");
      spare_failures_ = limits::kMaxSpareFailures;
      return;
    }
  }
  int live = 0;
  for (const auto& s : spares_) live += !s->reaped;
  for (; live < opts_.spares; ++live) {
    const std::size_t before = spares_.size();
    spawn_one(0, *spare_round_, spare_spec_, false, true);
    if (spares_.size() == before) return;  // could not start one (said why)
    spdlog::info("--spares: spare started (pid {})", spares_.back()->pid);
  }
}

bool WorkerGroup::take_spare(int lr, const v1::Assignment& a, const WorkerEnvSpec& round,
                             bool watch_progress) {
  auto it = std::find_if(spares_.begin(), spares_.end(), [](const auto& s) {
    return s->spare_ready && !s->reaped && s->control && s->control->is_open();
  });
  if (it == spares_.end()) return false;
  Worker& s = **it;
  Worker probe;
  probe.local_rank = lr;
  probe.rank = a.rank_offset() + lr;
  std::map<std::string, std::string> want = worker_env(lr, a, round, watch_progress, probe);
  want[env::kControlFd] = s.env[env::kControlFd];  // its own channel stays
  ops::control::Message m{ops::control::kTake, {}};
  auto sayable = [](const std::string& text) {
    if (text.empty()) return false;
    for (unsigned char c : text) {
      if (c <= ' ' || c > '~') return false;
    }
    return true;
  };
  for (const auto& [name, value] : want) {
    auto had = s.env.find(name);
    if (had != s.env.end() && had->second == value) continue;
    if (!sayable(name) || name.find('=') != std::string::npos || !sayable(value)) {
      spdlog::info("--spares: {} of local rank {} cannot be said in a take; a new process", name,
                   lr);
      return false;
    }
    m.fields[name] = value;
  }
  for (const auto& [name, value] : s.env) {
    if (name != env::kSpare && want.count(name) == 0) {
      spdlog::info("--spares: local rank {} has no {}, which the spare has; a new process", name,
                   lr);
      return false;
    }
  }
  const std::string packet = ops::control::encode(m);
  if (packet.size() > ops::control::kMaxMessageBytes) {
    spdlog::info("--spares: local rank {}'s environment is too long for a take; a new process",
                 lr);
    return false;
  }
  if (::send(s.control->native_handle(), packet.data(), packet.size(),
             MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(packet.size())) {
    spdlog::warn("--spares: cannot write to spare pid {}: {}; a new process", s.pid,
                 std::strerror(errno));
    return false;
  }
  // It is that rank now: its lines say so, and the hang watch may read its page.
  std::unique_ptr<Worker> w = std::move(*it);
  spares_.erase(it);
  w->spare = false;
  w->spare_ready = false;
  w->env.clear();
  w->local_rank = lr;
  w->rank = probe.rank;
  w->error_file = probe.error_file;
  w->page = probe.page;
  const std::string tmpl =
      opts_.prefix_template.empty() ? std::string(kDefaultPrefixTemplate) : opts_.prefix_template;
  const std::string prefix = expand_prefix_template(tmpl, opts_.role, w->rank, lr);
  w->out->splitter.set_prefix(prefix);
  w->err->splitter.set_prefix(prefix);
  if (lr < static_cast<int>(opts_.numa_of.size())) bind_cpus(w->pid, opts_.numa_of[lr].cpus);
  if (w->niced) set_nice(w->pid, 0);  // a worker now: as urgent as the others
  spare_failures_ = 0;
  spdlog::info("--spares: spare pid {} takes local rank {} (rank {})", w->pid, lr, w->rank);
  workers_.push_back(std::move(w));
  return true;
}

void WorkerGroup::on_spare_exit(Worker& w, int status) {
  ::kill(-w.pid, SIGKILL);  // what it started goes with it
  if (opts_.supervisor != nullptr) opts_.supervisor->forget_group(w.pid);
  auto it = std::find_if(spares_.begin(), spares_.end(),
                         [&](const auto& s) { return s.get() == &w; });
  if (it != spares_.end()) {
    retired_.push_back(std::move(*it));  // its pipes may still drain
    spares_.erase(it);
  }
  if (warm_done_) {
    warm_done(absl::StrCat("a spare (pid ", w.pid, ") exited before it waited in "
                           "muster_inplace.await_rank()"));
    return;
  }
  if (stopping_ || ended_ || all_reaped()) return;  // no round to wait for
  ++spare_failures_;
  const std::string how = WIFSIGNALED(status) ? absl::StrCat("signal ", WTERMSIG(status))
                                              : absl::StrCat("exit code ", WEXITSTATUS(status));
  if (spare_failures_ >= limits::kMaxSpareFailures) {
    spdlog::warn("--spares: a spare (pid {}) exited ({}), {} in a row: going on without spares",
                 w.pid, how, spare_failures_);
    return;
  }
  spdlog::warn("--spares: a spare (pid {}) exited ({}); starting another", w.pid, how);
  top_up_spares();
}

void WorkerGroup::warm_up(const v1::Assignment& a, const WorkerEnvSpec& spec,
                          std::function<void()> done) {
  spare_round_ = a;
  spare_spec_ = spec;
  warm_done_ = std::move(done);
  for (int i = 0; i < opts_.nproc_per_node; ++i) {
    const std::size_t before = spares_.size();
    spawn_one(0, a, spec, false, true);
    if (spares_.size() == before) {
      warm_done("a spare could not be started");
      return;
    }
  }
  timers_->warm.expires_after(limits::kSpareWarmTimeout);
  timers_->warm.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && warm_done_) {
      warm_done(absl::StrCat("no spare waited in muster_inplace.await_rank() within ",
                             limits::kSpareWarmTimeout.count(), " s"));
    }
  });
}

// The warm-up is over: `why` empty when every spare is ready; else the program cannot wait
// as a spare, and the node goes on without spares.
void WorkerGroup::warm_done(const std::string& why) {
  auto done = std::move(warm_done_);
  warm_done_ = nullptr;
  timers_->warm.cancel();
  if (!why.empty()) {
    spdlog::warn("--spares: {}: the program cannot wait as a spare; its workers start as usual",
                 why);
    spare_capable_ = false;
    spare_failures_ = limits::kMaxSpareFailures;
    kill_spares();
  }
  if (done) boost::asio::post(io_, std::move(done));  // not from inside a handler of ours
}

void WorkerGroup::kill_spares() {
  for (const auto& s : spares_) {
    if (s->pid > 0 && !s->reaped) ::kill(-s->pid, SIGKILL);
  }
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

// --- hangs and timers ----------------------------------------------------------------------

void WorkerGroup::dump_stalled(int rank, const std::string& description) {
  if (hang_) return;
  Worker* w = nullptr;
  for (const auto& x : workers_) {
    if (x->rank == rank && !x->reaped) w = x.get();
  }
  if (w == nullptr) return;
  if (hang_watch_) hang_watch_->stop();
  hang_ = std::make_unique<Hang>();
  hang_->worker = w;
  hang_->what = description;
  hang_->stack_file = (std::filesystem::path(w->error_file).parent_path() / "stacks.txt").string();
  spdlog::warn("hang: {}; writing its stacks to {}", hang_->what, hang_->stack_file);
  if (!opts_.python_interpreter.empty() && w->err && w->err->sd.is_open()) {
    w->err->capture = open_log(hang_->stack_file);
    ::kill(w->pid, SIGABRT);  // faulthandler prints every thread's traceback, then it dies
    timers_->hang.expires_after(limits::kStackDumpBudget);
    timers_->hang.async_wait([this](const boost::system::error_code& ec) {
      if (!ec) finish_hang();
    });
    return;
  }
  stack_dump_ = StackDump::start(io_, w->pid, hang_->stack_file, limits::kStackDumpBudget,
                                 opts_.gdb_path, [this](const std::string&) { finish_hang(); });
}

void WorkerGroup::finish_hang() {
  if (!hang_ || hang_->reported) return;
  hang_->reported = true;
  timers_->hang.cancel();
  Worker& w = *hang_->worker;
  if (w.err && w.err->capture >= 0) {
    ::close(w.err->capture);
    w.err->capture = -1;
  }
  v1::WorkerFailure f = describe(w);
  f.set_message("hang: " + hang_->what + " (stacks: " + hang_->stack_file + ")");
  std::ifstream in(hang_->stack_file);
  std::string stacks(limits::kMaxFailureTracebackBytes, '\0');
  in.read(stacks.data(), static_cast<std::streamsize>(stacks.size()));
  stacks.resize(static_cast<std::size_t>(in.gcount()));
  f.set_traceback(stacks);
  cb_.hang_dumped(f);  // last: it may release the group
}

void WorkerGroup::on_file_timer(const FileTimerTable::Expired& e) {
  for (const auto& w : workers_) {
    if (w->pid != e.pid || w->reaped) continue;
    if (e.signal <= 0) {
      spdlog::warn("file timer: scope '{}' of worker rank {} (pid {}) expired; no signal was "
                   "given, so it is left running",
                   e.scopes.front(), w->rank, w->pid);
      return;
    }
    spdlog::warn("file timer: scope '{}' of worker rank {} (local rank {}, pid {}) expired; "
                 "sending {}",
                 e.scopes.front(), w->rank, w->local_rank, w->pid, signal_name(e.signal));
    w->timer_scope = e.scopes.front();
    ::kill(w->pid, e.signal);
    return;
  }
  spdlog::debug("file timer: pid {} is not one of this agent's workers; not signalled", e.pid);
}

std::string WorkerGroup::python_hint(const v1::WorkerFailure& root, int group_rank) const {
  if (root.host() == opts_.host && root.group_rank() == group_rank) {
    std::string h = module_not_found_hint(root.message() + "\n" + root.traceback(), root.rank(),
                                          opts_.python_interpreter);
    if (!h.empty()) return h;
  }
  for (const auto& w : workers_) {
    if (w->err == nullptr) continue;
    std::string h = module_not_found_hint(w->err->tail, w->rank, opts_.python_interpreter);
    if (!h.empty()) return h;
  }
  return "";
}

}  // namespace muster::agent
