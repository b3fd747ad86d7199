#include "muster/agent/agent.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/agent/failure.h"
#include "muster/agent/file_timer.h"
#include "muster/agent/hang_watch.h"
#include "muster/agent/line_splitter.h"
#include "muster/agent/proc_state.h"
#include "muster/agent/process.h"
#include "muster/agent/worker_env.h"
#include "muster/rendezvous/limits.h"
#include "muster/worker/progress_page.h"
#include "muster/rendezvous/client.h"
#include "muster/rendezvous/host_id.h"
#include "muster/rendezvous/resolve.h"

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


// A free TCP port on this host, for MASTER_PORT (as torchrun: bind port 0, then release).
int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

std::int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

class Agent::Impl {
 public:
  Impl(asio::io_context& io, AgentOptions opts)
      : io_(io),
        opts_(std::move(opts)),
        grace_timer_(io),
        drain_timer_(io),
        unkillable_timer_(io),
        keep_alive_timer_(io),
        silence_timer_(io),
        window_(std::chrono::duration_cast<std::chrono::milliseconds>(
            opts_.rdzv_timeouts.keep_alive_interval * opts_.rdzv_timeouts.keep_alive_max_attempt)),
        endpoints_(endpoint_list(opts_)),
        hang_timer_(io) {
    if (opts_.rdzv_name.empty()) opts_.rdzv_name = opts_.rdzv_target;
  }

  static std::vector<RdzvEndpoint> endpoint_list(const AgentOptions& o) {
    std::vector<RdzvEndpoint> list{{o.rdzv_target, o.rdzv_name.empty() ? o.rdzv_target : o.rdzv_name}};
    list.insert(list.end(), o.rdzv_more.begin(), o.rdzv_more.end());
    return list;
  }

  int run() {
    if (opts_.wait_for_server) {
      // The wait is the session client's reader thread's: this loop keeps serving signals.
      spdlog::info("waiting for the rendezvous server at {} (up to {} ms)", opts_.rdzv_name,
                   opts_.connect_timeout.count());
    }
    if (!opts_.file_timer_path.empty()) {
      auto timers = FileTimerServer::start(io_, opts_.file_timer_path,
                                           [this](const FileTimerTable::Expired& e) { on_timer_expired(e); });
      if (!timers.ok()) {
        spdlog::error("{}", std::string(timers.status().message()));
        return 1;
      }
      file_timers_ = std::move(*timers);
    }
    if (opts_.wait_for_server) {
      first_deadline_ = std::chrono::steady_clock::now() + opts_.connect_timeout;
    }
    open_session(opts_.wait_for_server, opts_.connect_timeout);
    send_join();
    keep_alive();
    io_.run();
    if (client_) client_->close();
    return exit_code_;
  }

 private:
  // One worker output stream: to the console (whole prefixed lines; -1: not shown) and/or to
  // a log file (raw; -1: none).
  struct Pipe {
    Pipe(asio::io_context& io, int fd, std::string prefix, int console, int file)
        : sd(io, fd), splitter(std::move(prefix)), console(console), file(file) {}
    ~Pipe() {
      if (file >= 0) ::close(file);
    }
    Descriptor sd;
    LineSplitter splitter;
    int console;
    int file;
    // The attempt's filtered_std{out,err}.log (owned by Impl) and its filters; -1: none.
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
  struct Worker {
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
    bool released = false;  // abandoned, and its round is over (it lives in abandoned_)
  };
  // A stalled worker being dumped (--hang_timeout): reported once its stacks are written.
  struct Hang {
    Worker* worker = nullptr;
    std::string what;        // Stall::describe
    std::string stack_file;
    bool reported = false;
  };
  enum class Phase { kJoining, kRunning, kStopping, kAwaitingDone, kExiting };
  // What to do once the stopping group has fully exited.
  enum class After { kNone, kRejoin, kReconnect, kFail, kExit };

  // --- rendezvous ---------------------------------------------------------------------

  void send_join() {
    phase_ = Phase::kJoining;
    client_->send(join_message(false));  // a dead stream reports itself through on_session_closed
  }

  // A Join; with `reattach`, one that asks for this node's place in the running round back.
  v1::AgentMsg join_message(bool reattach) {
    v1::AgentMsg msg;
    v1::Join* j = msg.mutable_join();
    j->set_run_id(opts_.run_id);
    j->set_node_id(opts_.node_id);
    j->set_host(opts_.host);
    j->set_local_world_size(opts_.nproc_per_node);
    j->set_min_nodes(opts_.min_nodes);
    j->set_max_nodes(opts_.max_nodes);
    j->set_master_port_candidate(pick_free_port());
    j->set_token(opts_.token);
    j->set_requested_rank(opts_.requested_rank);
    j->set_max_restarts(opts_.max_restarts);
    const auto& t = opts_.rdzv_timeouts;
    j->set_join_timeout_ms(t.join_timeout.count());
    j->set_last_call_timeout_ms(t.last_call_timeout.count());
    j->set_keep_alive_interval_ms(t.keep_alive_interval.count());
    j->set_keep_alive_max_attempt(t.keep_alive_max_attempt);
    // How long this node may take to stop its workers after a Restart: the server waits
    // that long for it before a round closes without it.
    j->set_shutdown_timeout_ms(opts_.shutdown_timeout.count());
    j->set_hang_timeout_ms(opts_.hang_timeout.count());
    j->set_max_restarts_without_progress(opts_.max_restarts_without_progress);
    j->set_restart_budget_reset_after_steps(opts_.restart_budget_reset_after_steps);
    j->set_reattach_timeout_ms(t.reattach_timeout.count());
    if (reattach) {
      j->set_reattach_round(assignment_.round());
      j->set_reattach_group_rank(assignment_.group_rank());
    }
    return msg;
  }

  // A new stream to the server (the first, or after the node lost it). Whatever the old
  // client still had to say is not heard: it was closed when it was given up.
  // Opens a new stream from the loop (not from inside the old client's callback), waiting for
  // the server until *deadline (read when it runs), then sends `join` (a re-attach or not);
  // nothing when the agent is exiting or the deadline is gone by then.
  void reopen_later(const std::optional<std::chrono::steady_clock::time_point>* deadline,
                    bool reattach) {
    asio::post(io_, [this, deadline, reattach] {
      if (phase_ == Phase::kExiting || after_ == After::kExit || !*deadline) return;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          **deadline - std::chrono::steady_clock::now());
      open_session(true, std::max(left, std::chrono::milliseconds(1)));
      if (reattach) {
        client_->send(join_message(true));
      } else {
        send_join();
      }
    });
  }

  void open_session(bool wait_for_ready, std::chrono::milliseconds connect_timeout) {
    if (client_) client_->close();
    client_ = std::make_unique<rendezvous::SessionClient>(
        io_, [this](const v1::ServerMsg& m) { on_server_message(m); },
        [this](const absl::Status& s) { on_session_closed(s); });
    rendezvous::SessionClient::OpenOptions o;
    o.target = endpoints_.current().target;
    o.name = endpoints_.current().name;
    o.wait_for_ready = wait_for_ready;
    // With several endpoints each attempt is bounded, so the next gets its turn.
    o.connect_timeout = endpoints_.attempt(connect_timeout, window_);
    o.liveness_window = window_;
    o.on_ready = [this] { heard_from_server(); };
    o.tls = opts_.tls;
    stop_silence_timer();
    client_->open(std::move(o));
  }

  void keep_alive() {
    keep_alive_timer_.expires_after(opts_.rdzv_timeouts.keep_alive_interval);
    keep_alive_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec || phase_ == Phase::kExiting) return;
      v1::AgentMsg msg;
      msg.mutable_keep_alive();
      client_->send(msg);
      keep_alive();
    });
  }

  // The liveness rule, this side: the server answers every keep-alive, so hearing nothing
  // from it for one window means this node is out of the run (the server, if it is there,
  // drops a node silent for as long). Stop the workers, then reconnect and join again.
  void heard_from_server() {
    last_heard_ = std::chrono::steady_clock::now();
    if (!silence_armed_) arm_silence_timer(last_heard_ + window_);
  }

  void stop_silence_timer() {
    silence_armed_ = false;
    silence_timer_.cancel();
  }

  void arm_silence_timer(std::chrono::steady_clock::time_point at) {
    silence_armed_ = true;
    silence_timer_.expires_at(at);
    silence_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;  // cancelled, or re-armed (which cancels the earlier wait)
      const auto due = last_heard_ + window_;
      if (std::chrono::steady_clock::now() < due) {
        arm_silence_timer(due);  // heard from it since: wait for the new end of the window
        return;
      }
      silence_armed_ = false;
      if (phase_ == Phase::kExiting || after_ == After::kExit || after_ == After::kFail ||
          after_ == After::kReconnect) {
        return;
      }
      client_->close();  // give the stream up: whatever the server says now comes too late
      const std::string silence = absl::StrFormat(
          "nothing heard from it for %g s, the run's liveness window",
          static_cast<double>(window_.count()) / 1000);
      if (reattach_deadline_) {
        // A new stream that stays silent is one more failed attempt; the server holds this
        // node's place meanwhile. (Silence while attached keeps today's rule, below.)
        reattach(silence);
        return;
      }
      if (!reached_ && !rejoin_deadline_) {
        never_reached(absl::StrCat("connected, but ", silence));
        return;
      }
      lost_server(silence);
    });
  }

  // --- events (agent_events.h) --------------------------------------------------------

  AgentEvent event(AgentEvent::Kind kind) const {
    AgentEvent e;
    e.kind = kind;
    e.at = std::chrono::steady_clock::now();
    e.wall = std::chrono::system_clock::now();
    e.round = assignment_.round();
    e.restart_count = assignment_.restart_count();
    e.group_rank = assignment_.round() > 0 ? assignment_.group_rank() : -1;
    return e;
  }
  void emit(const AgentEvent& e) const {
    for (const auto& sink : opts_.event_sinks) sink(e);
  }
  // The round is over for this node (the first sign of it): a recovery starts, timed until
  // the next round's workers run.
  void noticed(const char* cause) {
    if (recovery_ || phase_ != Phase::kRunning) return;
    recovery_.emplace();
    recovery_->cause = cause;
    recovery_->noticed = std::chrono::steady_clock::now();
  }

  void on_server_message(const v1::ServerMsg& m) {
    if (phase_ == Phase::kExiting) return;
    reached_ = true;
    rejoin_deadline_.reset();
    heard_from_server();
    if (m.has_keep_alive()) return;
    if (m.has_attached()) {
      on_attached(m.attached());
    } else if (m.has_assignment()) {
      if (phase_ != Phase::kJoining) return;
      attached_ = true;
      start_workers(m.assignment());
    } else if (m.has_restart()) {
      spdlog::warn("restarting workers: {}", m.restart().reason());
      noticed("restart");
      AgentEvent e = event(AgentEvent::Kind::kRestart);
      e.reason = m.restart().reason();
      e.restart_count = m.restart().restart_count();
      emit(e);
      if (after_ != After::kExit) after_ = After::kRejoin;
      stop_group(SIGTERM);
    } else if (m.has_fail()) {
      fail_ = m.fail();
      if (after_ != After::kExit) after_ = After::kFail;
      stop_group(SIGTERM);
    } else if (m.has_done()) {
      if (phase_ == Phase::kAwaitingDone) {
        emit(event(AgentEvent::Kind::kSucceeded));
        finish(0);
      }
    } else if (m.has_stalled()) {
      if (m.stalled().round() == assignment_.round()) {
        on_stalled(m.stalled().rank(), m.stalled().description());
      }
    }
  }

  void on_session_closed(const absl::Status& status) {
    if (phase_ == Phase::kExiting || after_ == After::kExit || after_ == After::kFail) return;
    stop_silence_timer();
    // A refusal (token, bad config, timeout) carries its own message; a lost connection
    // says which server went away, or that it was never reached.
    const bool lost = status.ok() || status.code() == absl::StatusCode::kUnavailable ||
                      status.code() == absl::StatusCode::kCancelled;
    std::string why = status.ok() ? std::string("it ended the session") : std::string(status.message());
    const bool timed_out = status.code() == absl::StatusCode::kDeadlineExceeded;
    // The server's process gone (its stream broke at once) while this node's workers run in a
    // round of a server that keeps its runs: keep them, reconnect and re-attach.
    if (reattach_deadline_ ? (lost || timed_out) : (lost && reached_ && can_reattach())) {
      reattach(why);
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!reached_ && endpoints_.size() > 1 && first_deadline_ && (lost || timed_out)) {
      if (now < *first_deadline_) {
        // Never reached yet: the next endpoint gets its turn, until the wait is over.
        endpoints_.next();
        reopen_later(&first_deadline_, false);
        return;
      }
      spdlog::error("rendezvous: none of the servers at {} was reachable within {} s",
                    endpoints_.names(), static_cast<double>(opts_.connect_timeout.count()) / 1000);
      exit_with(1);
      return;
    }
    if (rejoin_deadline_ && (lost || timed_out)) {
      endpoints_.next();  // this attempt failed: the next endpoint (the same one if it is alone)
      lost_server(why);  // tries again until the deadline, then says it could not
      return;
    }
    if (lost && reached_) {
      lost_server(why);
      return;
    }
    if (lost) {
      never_reached(why);
      return;
    }
    spdlog::error("rendezvous: {}", std::string(status.message()));
    exit_with(1);
  }

  void never_reached(const std::string& why) {
    spdlog::error("rendezvous: never reached the server at {} ({})", endpoints_.names(), why);
    exit_with(1);
  }

  // --- re-attach (docs/rendezvous.md, "Restarting the server without restarting workers") --

  // Whether this node may keep its workers through the loss of its stream: it is in a round
  // of a server that keeps its runs, and the round is not over for it yet (its workers run,
  // or they succeeded or failed and it waits for the server's word).
  bool can_reattach() const {
    if (assignment_.round() == 0 || assignment_.reattach_timeout_ms() <= 0) return false;
    return phase_ == Phase::kRunning || phase_ == Phase::kAwaitingDone ||
           (phase_ == Phase::kStopping && after_ == After::kNone);
  }

  // One attempt to re-attach (the first after the loss, or the next after a failed one): a
  // new stream to the current endpoint (the next one after a failure) and a Join asking for
  // this node's place back. The workers go on. When the run's re-attach window is over, the
  // node is out as today: it stops its workers and joins again.
  void reattach(const std::string& why) {
    const auto now = std::chrono::steady_clock::now();
    const auto window = std::chrono::milliseconds(assignment_.reattach_timeout_ms());
    if (!reattach_deadline_) {
      reattach_deadline_ = now + window;
      reattach_since_ = now;
      spdlog::warn("rendezvous: lost the stream to the server at {} ({}); the workers keep "
                   "running while this node re-attaches to run {} (for up to {} s)",
                   endpoints_.current().name, why, opts_.run_id,
                   static_cast<double>(window.count()) / 1000);
      AgentEvent e = event(AgentEvent::Kind::kLostServer);
      e.reason = absl::StrCat("re-attaching: ", why);
      emit(e);
      // With several endpoints the one whose stream just ended is the least likely to serve
      // next (replicas: the leader died; a standby takes over): the next one first.
      endpoints_.next();
    } else if (now >= *reattach_deadline_) {
      reattach_deadline_.reset();
      attached_ = true;
      spdlog::error("rendezvous: could not re-attach to run {} within {} s ({})", opts_.run_id,
                    static_cast<double>(window.count()) / 1000, why);
      lost_server(why);
      return;
    } else {
      endpoints_.next();
    }
    attached_ = false;
    reopen_later(&reattach_deadline_, true);
  }

  void on_attached(const v1::Attached& a) {
    if (!reattach_deadline_ || a.round() != assignment_.round()) return;  // not asked for
    reattach_deadline_.reset();
    attached_ = true;
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - reattach_since_);
    if (a.ok()) {
      // At warning level, as the loss was: the default log shows both or neither.
      spdlog::warn("rendezvous: re-attached to run {} round {} at {} after {} ms; the workers "
                   "kept running",
                   opts_.run_id, a.round(), endpoints_.current().name, took.count());
      AgentEvent e = event(AgentEvent::Kind::kReattached);
      e.reason = endpoints_.current().name;
      e.took = took;
      emit(e);
      // What this node last reported may have died with the old stream or the old server.
      if (last_report_) client_->send(*last_report_);
      return;
    }
    if (phase_ == Phase::kAwaitingDone) {
      spdlog::error("rendezvous: could not re-attach to run {} ({}) before the run's end was "
                    "confirmed",
                    opts_.run_id, a.reason());
      exit_with(1);
      return;
    }
    spdlog::warn("rendezvous: could not re-attach to run {} ({}); stopping workers and joining "
                 "again",
                 opts_.run_id, a.reason());
    noticed("lost_server");
    if (after_ != After::kExit) after_ = After::kRejoin;
    stop_group(SIGTERM);
  }

  // A failure or success report of this round: kept, to be sent again after a re-attach, and
  // sent now unless the node is between streams.
  void send_report(const v1::AgentMsg& msg) {
    last_report_ = msg;
    if (attached_) client_->send(msg);
  }

  // Stops the workers, then exits with `code`.
  void exit_with(int code) {
    exit_code_ = code;
    after_ = After::kExit;
    stop_group(SIGTERM);
  }

  // This node is out of its run (its stream ended, or the server went silent for the
  // window): its workers stop at once; then it reconnects and joins the run again, if the
  // run still wants it, for up to connect_timeout. Once its workers succeeded there is
  // nothing to rejoin for: it exits 1, as the run's end was never confirmed.
  void lost_server(const std::string& why) {
    const double secs = static_cast<double>(opts_.connect_timeout.count()) / 1000;
    if (phase_ == Phase::kAwaitingDone) {
      spdlog::error("rendezvous: lost the server at {} ({}) before the run's end was confirmed",
                    endpoints_.names(), why);
      exit_with(1);
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!rejoin_deadline_) {
      rejoin_deadline_ = now + opts_.connect_timeout;
      spdlog::error("rendezvous: lost the server at {} ({}); stopping workers, then joining "
                    "again (for up to {} s)",
                    endpoints_.names(), why, secs);
    } else if (now >= *rejoin_deadline_) {
      spdlog::error("rendezvous: lost the server at {} and could not reach it again within {} s "
                    "({})",
                    endpoints_.names(), secs, why);
      exit_with(1);
      return;
    }
    noticed("lost_server");
    AgentEvent e = event(AgentEvent::Kind::kLostServer);
    e.reason = why;
    emit(e);
    after_ = After::kReconnect;
    stop_group(SIGTERM);
  }

  // --- workers ------------------------------------------------------------------------

  void start_workers(const v1::Assignment& a) {
    assignment_ = a;
    {
      AgentEvent e = event(AgentEvent::Kind::kRoundFormed);
      e.world_size = a.world_size();
      emit(e);
      if (recovery_) recovery_->formed = e.at;
    }
    phase_ = Phase::kRunning;
    after_ = After::kNone;
    failure_reported_ = false;
    last_report_.reset();
    stopped_emitted_ = false;
    release_workers();
    const std::string tmpl =
        opts_.prefix_template.empty() ? std::string(kDefaultPrefixTemplate) : opts_.prefix_template;
    open_filtered_logs(std::filesystem::path(opts_.error_dir) /
                       ("attempt_" + std::to_string(a.restart_count())));
    // The run uses progress pages: a hang timeout, or a budget that knows progress.
    const bool watch_progress = a.hang_timeout_ms() > 0 || a.wants_progress();
    std::vector<HangWatch::Watched> watched;
    for (int lr = 0; lr < opts_.nproc_per_node; ++lr) {
      auto w = std::make_unique<Worker>();
      w->local_rank = lr;
      w->rank = a.rank_offset() + lr;
      std::filesystem::path dir = std::filesystem::path(opts_.error_dir) /
                                  ("attempt_" + std::to_string(a.restart_count())) /
                                  std::to_string(lr);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      w->error_file = (dir / "error.json").string();
      WorkerEnvSpec spec;
      spec.local_rank = lr;
      spec.local_world_size = opts_.nproc_per_node;
      spec.rank_offset = a.rank_offset();
      spec.world_size = a.world_size();
      spec.group_rank = a.group_rank();
      spec.group_world_size = a.group_world_size();
      spec.role = opts_.role;
      spec.master_addr = opts_.master_addr.empty() ? a.master_addr() : opts_.master_addr;
      spec.master_port = opts_.master_addr.empty() ? a.master_port() : opts_.master_port;
      if (opts_.master_addr.empty() && opts_.use_agent_store && a.agent_store_port() > 0) {
        spec.master_addr = rendezvous::host_of(endpoints_.current().name);
        spec.master_port = a.agent_store_port();
        spec.use_agent_store = true;
      }
      spec.restart_count = a.restart_count();
      spec.max_restarts = opts_.max_restarts;
      spec.run_id = opts_.run_id;
      spec.error_file = w->error_file;
      // The store's Unix-domain socket when the server runs on this machine and network
      // namespace (faster than TCP loopback), else the address the agent was given.
      spec.store_addr = store_target_for_workers(
          a.store_local_target(), a.server_host_identity(), host_identity_,
          opts_.store_addr == opts_.rdzv_target ? endpoints_.current().target : opts_.store_addr);
      // Several endpoints (replicas): the others too, in the order this agent would try them,
      // so a worker's store calls follow a failover (GrpcStoreOptions::target).
      if (opts_.store_addr == opts_.rdzv_target) {
        for (std::size_t k = 1; k < endpoints_.size(); ++k) {
          absl::StrAppend(&spec.store_addr, ";", endpoints_.after(k).target);
        }
      }
      spec.round = a.round();
      spec.node_addr = opts_.host;
      spec.token = opts_.token;
      spec.tls = opts_.tls.files;
      spec.signals_to_handle = opts_.signals_to_handle;
      spec.virtual_local_rank = opts_.virtual_local_rank;
      std::vector<std::string> argv = opts_.argv;
      for (std::size_t i = 1; i < argv.size(); ++i) argv[i] = substitute_local_rank(argv[i], lr);
      SpawnRequest req;
      req.path = opts_.program_path;
      req.argv = std::move(argv);
      std::map<std::string, std::string> env = build_worker_env(opts_.base_env, spec);
      std::string page;  // this worker's progress page, once made
      if (watch_progress) {
        if (absl::Status s = HangWatch::create_page((dir / "progress").string()); s.ok()) {
          page = (dir / "progress").string();
          env[worker::kProgressFileVar] = page;
        } else {
          spdlog::warn("--hang_timeout: {}; rank {} is not watched", std::string(s.message()),
                       w->rank);
        }
        // A Python worker's tracebacks on SIGABRT, for its stack file (docs/hangs.md).
        if (!opts_.python_interpreter.empty() && a.hang_timeout_ms() > 0) {
          env.emplace("PYTHONFAULTHANDLER", "1");
          if (!opts_.python_progress_hook.empty()) {
            std::string& path = env["PYTHONPATH"];
            path = path.empty() ? opts_.python_progress_hook
                                : absl::StrCat(opts_.python_progress_hook, ":", path);
          }
        }
      }
      req.envp = to_envp(env);
      if (opts_.workers_stdin_null) req.stdin_mode = SpawnRequest::Stdin::kNull;
      req.cgroup_procs_fd = opts_.supervisor != nullptr ? opts_.supervisor->cgroup_procs_fd() : -1;
      if (lr < static_cast<int>(opts_.numa_of.size())) {
        req.cpus.assign(opts_.numa_of[lr].cpus.begin(), opts_.numa_of[lr].cpus.end());
        req.memory_node = opts_.numa_of[lr].memory_node;
      }
      absl::StatusOr<ChildProcess> child = spawn_worker(req);
      if (!child.ok()) {
        spdlog::error("cannot start worker local rank {}: {}", lr,
                      std::string(child.status().message()));
        workers_.push_back(std::move(w));
        v1::WorkerFailure f = describe(*workers_.back());
        f.set_exit_code(127);
        f.set_message(std::string(child.status().message()));
        report_failure(f);
        stop_group(SIGTERM);
        return;
      }
      w->pid = child->pid;
      if (!page.empty()) watched.push_back({w->rank, lr, w->pid, page});
      if (opts_.supervisor != nullptr) opts_.supervisor->track_group(child->pid);
      std::string prefix = expand_prefix_template(tmpl, opts_.role, w->rank, lr);
      w->out = make_pipe(child->out_fd, prefix, lr, 1, opts_.stdout_fd, dir / "stdout.log");
      w->err = make_pipe(child->err_fd, prefix, lr, 2, opts_.stderr_fd, dir / "stderr.log");
      w->out->filtered = filtered_[0].fd;
      w->out->filters = &opts_.duplicate_stdout_filters;
      w->err->filtered = filtered_[1].fd;
      w->err->filters = &opts_.duplicate_stderr_filters;
      w->err->keep_tail = !opts_.python_interpreter.empty();
      w->pidfd = std::make_unique<Descriptor>(io_, child->pidfd);
      Worker* raw = w.get();
      workers_.push_back(std::move(w));
      read_pipe(raw, raw->out.get());
      read_pipe(raw, raw->err.get());
      watch_exit(raw);
    }
    if (watch_progress) {
      // The run's rule (the first node's --hang_timeout, or rdzvd's): sampled here, applied by
      // the server over every node's ranks. Without a hang timeout (only the budget that
      // knows progress), a sample a second.
      const auto timeout = a.hang_timeout_ms() > 0 ? std::chrono::milliseconds(a.hang_timeout_ms())
                                                   : std::chrono::milliseconds(4000);
      if (!hang_watch_ || hang_timeout_ != timeout) {
        hang_timeout_ = timeout;
        hang_watch_ = std::make_unique<HangWatch>(
            io_, timeout,
            [this](const std::vector<rendezvous::RankProgress>& ranks,
                   rendezvous::StallClock::time_point now) { send_progress(ranks, now); });
      }
      hang_watch_->start_round(watched);
    }
    {
      AgentEvent e = event(AgentEvent::Kind::kWorkersStarted);
      e.world_size = a.world_size();
      e.workers = static_cast<int>(workers_.size());
      if (recovery_) {
        recovery_->started = e.at;
        // Stopped before the round formed, unless nothing was running to stop.
        if (recovery_->stopped.time_since_epoch().count() == 0) {
          recovery_->stopped = recovery_->formed;
        }
        e.recovery = std::move(recovery_);
        recovery_.reset();
      }
      emit(e);
    }
    spdlog::info("round {}: group rank {}/{}, ranks {}..{} of {}, restart {}", a.round(),
                 a.group_rank(), a.group_world_size(), a.rank_offset(),
                 a.rank_offset() + opts_.nproc_per_node - 1, a.world_size(), a.restart_count());
  }

  std::unique_ptr<Pipe> make_pipe(int fd, const std::string& prefix, int lr, int bit, int console,
                                  const std::filesystem::path& log) {
    auto at = [lr](const auto& v, auto fallback) {
      return lr < static_cast<int>(v.size()) ? v[lr] : fallback;
    };
    const bool redirect = at(opts_.redirect_of, 0) & bit;
    const bool to_file = redirect || (at(opts_.tee_of, 0) & bit);
    const bool shown = !redirect && at(opts_.console_of, true);
    int file = -1;
    if (to_file) {
      file = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (file < 0) spdlog::error("cannot write {}: {}", log.string(), std::strerror(errno));
    }
    return std::make_unique<Pipe>(io_, fd, prefix, shown ? console : -1, file);
  }

  // One filtered_std{out,err}.log per attempt, for the streams that have filters.
  void open_filtered_logs(const std::filesystem::path& attempt_dir) {
    const std::vector<std::string>* filters[2] = {&opts_.duplicate_stdout_filters,
                                                  &opts_.duplicate_stderr_filters};
    const char* names[2] = {"filtered_stdout.log", "filtered_stderr.log"};
    for (int i = 0; i < 2; ++i) {
      filtered_[i].reset();
      if (filters[i]->empty()) continue;
      std::error_code ec;
      std::filesystem::create_directories(attempt_dir, ec);
      const std::filesystem::path path = attempt_dir / names[i];
      filtered_[i].fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (filtered_[i].fd < 0) {
        spdlog::error("cannot write {}: {}", path.string(), std::strerror(errno));
      }
    }
  }

  // The whole prefixed lines in `lines` whose text contains one of the pipe's filters go to
  // its filtered log.
  static void write_filtered(const Pipe& p, std::string_view lines) {
    if (p.filtered < 0 || p.filters == nullptr) return;
    const std::size_t skip = p.splitter.prefix().size();
    std::string matched;
    while (!lines.empty()) {
      const std::size_t nl = lines.find('\n');
      const std::size_t len = nl == std::string_view::npos ? lines.size() : nl + 1;
      std::string_view line = lines.substr(0, len);
      std::string_view text = line.substr(std::min(skip, line.size()));
      if (!text.empty() && text.back() == '\n') text.remove_suffix(1);
      for (const std::string& f : *p.filters) {
        if (text.find(f) != std::string_view::npos) {
          matched.append(line);
          break;
        }
      }
      lines.remove_prefix(len);
    }
    if (!matched.empty()) write_all(p.filtered, matched);
  }

  void read_pipe(Worker* w, Pipe* p) {
    p->sd.async_read_some(
        asio::buffer(p->buf), [this, w, p](const boost::system::error_code& ec, std::size_t n) {
          if (ec == asio::error::operation_aborted && phase_ == Phase::kExiting) return;
          p->out.clear();
          if (!ec) {
            if (p->keep_tail) {
              p->tail.append(p->buf.data(), n);
              if (p->tail.size() > Pipe::kTailBytes) {
                p->tail.erase(0, p->tail.size() - Pipe::kTailBytes);
              }
            }
            if (p->file >= 0) write_all(p->file, std::string_view(p->buf.data(), n));
            if (p->capture >= 0) write_all(p->capture, std::string_view(p->buf.data(), n));
            if (p->console >= 0) {
              p->splitter.feed(std::string_view(p->buf.data(), n), p->out);
              write_all(p->console, p->out);
              write_filtered(*p, p->out);
            }
            read_pipe(w, p);
            return;
          }
          if (p->console >= 0) {
            p->splitter.finish(p->out);  // EOF or forced close: flush the partial line
            write_all(p->console, p->out);
            write_filtered(*p, p->out);
          }
          boost::system::error_code ignored;
          p->sd.close(ignored);
          if (hang_ && hang_->worker == w && p == w->err.get()) finish_hang();  // tracebacks in
          advance();
        });
  }

  void watch_exit(Worker* w) {
    w->pidfd->async_wait(Descriptor::wait_read, [this, w](const boost::system::error_code& ec) {
      if (ec) return;
      int status = 0;
      pid_t r = ::waitpid(w->pid, &status, WNOHANG);
      if (r == 0) {
        watch_exit(w);
        return;
      }
      w->reaped = true;
      w->pidfd->close();
      if (w->released) {
        // Left behind in an earlier round; what is left of its group goes with it, and its
        // group id may now be reused.
        spdlog::info("worker rank {} (pid {}), left behind stuck in the kernel, has exited", w->rank,
                     w->pid);
        ::kill(-w->pid, SIGKILL);
        if (opts_.supervisor != nullptr) opts_.supervisor->forget_group(w->pid);
        return;
      }
      on_worker_exit(*w, status);
    });
  }

  v1::WorkerFailure describe(const Worker& w) const {
    v1::WorkerFailure f;
    f.set_host(opts_.host);
    f.set_rank(w.rank);
    f.set_local_rank(w.local_rank);
    f.set_group_rank(assignment_.group_rank());
    f.set_pid(w.pid);
    f.set_timestamp_ms(wall_ms());
    f.set_error_file(w.error_file);
    return f;
  }

  // A worker's file timer expired (torch's FileTimerServer rule): send it the timer's signal.
  // Only the agent's own current workers are signalled.
  void on_timer_expired(const FileTimerTable::Expired& e) {
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

  void send_progress(const std::vector<rendezvous::RankProgress>& ranks,
                     rendezvous::StallClock::time_point now) {
    if (phase_ != Phase::kRunning || !client_ || !attached_) return;
    v1::AgentMsg msg;
    v1::Progress* p = msg.mutable_progress();
    p->set_round(assignment_.round());
    for (const rendezvous::RankProgress& r : ranks) {
      v1::RankProgress* x = p->add_ranks();
      x->set_rank(r.rank);
      x->set_local_rank(r.local_rank);
      x->set_pid(r.pid);
      x->set_step(r.step);
      x->set_reports(r.reports);
      x->set_phase(r.phase);
      x->set_still_ms(std::chrono::duration_cast<std::chrono::milliseconds>(now - r.changed).count());
    }
    client_->send(msg);
  }

  // --hang_timeout: the server found rank `rank` of this node stalled (rendezvous/stall.h).
  // Its stacks go to stacks.txt beside its logs: a Python worker's own tracebacks
  // (faulthandler, on SIGABRT, from its stderr), else gdb's or the kernel's view; then the
  // group fails with the hang as its cause.
  void on_stalled(int rank, const std::string& description) {
    if (phase_ != Phase::kRunning || hang_) return;
    Worker* w = nullptr;
    for (const auto& x : workers_) {
      if (x->rank == rank && !x->reaped) w = x.get();
    }
    if (w == nullptr) return;
    if (hang_watch_) hang_watch_->stop();
    Hang h;
    h.worker = w;
    h.what = description;
    h.stack_file = (std::filesystem::path(w->error_file).parent_path() / "stacks.txt").string();
    spdlog::warn("hang: {}; writing its stacks to {}", h.what, h.stack_file);
    hang_ = std::move(h);
    if (!opts_.python_interpreter.empty() && w->err && w->err->sd.is_open()) {
      w->err->capture = ::open(hang_->stack_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                               0644);
      ::kill(w->pid, SIGABRT);  // faulthandler prints every thread's traceback, then it dies
      hang_timer_.expires_after(limits::kStackDumpBudget);
      hang_timer_.async_wait([this](const boost::system::error_code& ec) {
        if (!ec) finish_hang();
      });
      return;
    }
    stack_dump_ = StackDump::start(io_, w->pid, hang_->stack_file, limits::kStackDumpBudget,
                                   opts_.gdb_path, [this](const std::string&) { finish_hang(); });
  }

  void finish_hang() {
    if (!hang_ || hang_->reported) return;
    hang_->reported = true;
    hang_timer_.cancel();
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
    if (phase_ == Phase::kRunning) report_failure(f);
    stop_group(SIGTERM);
  }

  void on_worker_exit(Worker& w, int status) {
    if (file_timers_) file_timers_->clear(w.pid);
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    const bool being_dumped = hang_ && hang_->worker == &w && !hang_->reported;
    if (!ok && phase_ == Phase::kRunning && !being_dumped) {
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
      spdlog::warn(
          "worker rank {} (local rank {}, pid {}) failed: {}", f.rank(), f.local_rank(), f.pid(),
          f.signal() > 0 ? signal_name(f.signal()) : "exit code " + std::to_string(f.exit_code()));
      noticed("worker_failure");
      AgentEvent e = event(AgentEvent::Kind::kWorkerFailed);
      e.rank = f.rank();
      e.local_rank = f.local_rank();
      e.pid = f.pid();
      e.exit_code = f.exit_code();
      e.signal = f.signal();
      e.reason = f.message();
      emit(e);
      report_failure(f);
      stop_group(SIGTERM);
      return;
    }
    if (all_reaped()) {
      // Whatever is left in the workers' process groups (and, with a job cgroup, whatever
      // they started anywhere) must not outlive them.
      signal_groups(SIGKILL);
      if (opts_.supervisor != nullptr) opts_.supervisor->kill_cgroup();
      arm_drain_timer();
    }
    advance();
  }

  void report_failure(const v1::WorkerFailure& f) {
    if (failure_reported_) return;
    failure_reported_ = true;
    v1::AgentMsg msg;
    msg.mutable_failure()->set_round(assignment_.round());
    *msg.mutable_failure()->mutable_root_cause() = f;
    send_report(msg);
  }

  bool all_reaped() const {
    for (const auto& w : workers_) {
      if (w->pid > 0 && !w->reaped && !w->abandoned) return false;
    }
    return true;
  }

  bool group_gone() const {
    if (!all_reaped()) return false;
    for (const auto& w : workers_) {
      if ((w->out && w->out->sd.is_open()) || (w->err && w->err->sd.is_open())) return false;
    }
    return true;
  }

  void signal_groups(int sig) {
    for (const auto& w : workers_) {
      if (w->pid > 0) ::kill(-w->pid, sig);
    }
  }

  // Sends `sig` to every worker's process group; SIGKILL follows after the grace.
  void stop_group(int sig) {
    if (hang_watch_) hang_watch_->stop();
    if (phase_ == Phase::kJoining || workers_.empty()) {
      phase_ = Phase::kStopping;
      advance();
      return;
    }
    const bool first = phase_ != Phase::kStopping;
    phase_ = Phase::kStopping;
    if (!all_reaped()) signal_groups(sig);
    if (first) {
      grace_timer_.expires_after(opts_.shutdown_timeout);
      grace_timer_.async_wait([this](const boost::system::error_code& ec) {
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
    advance();
  }

  // Drops the (reaped, killed) workers; their group ids may now be reused, so the supervisor
  // must no longer kill them. A worker left behind in the kernel is kept (abandoned_), its
  // pidfd watched and its group still the supervisor's, until it is reaped.
  void release_workers() {
    hang_timer_.cancel();
    unkillable_timer_.cancel();
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
  void arm_unkillable_timer() {
    unkillable_timer_.expires_after(limits::kUnkillableWait);
    unkillable_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec || phase_ != Phase::kStopping || all_reaped()) return;
      leave_stuck_workers();
    });
  }

  void leave_stuck_workers() {
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
    advance();
  }

  // At the job's end: the workers left behind that are still there, by pid (after the failure
  // summary, when there is one).
  void report_left_behind() const {
    for (const auto* list : {&workers_, &abandoned_}) {
      for (const auto& w : *list) {
        if (!w->abandoned || w->reaped) continue;
        spdlog::error("worker rank {} (pid {}) is stuck in the kernel (state {}{}{}) and was left "
                      "behind; it may still be there",
                      w->rank, w->pid, w->stuck.state, w->stuck.wchan.empty() ? "" : ", wchan ",
                      w->stuck.wchan);
      }
    }
  }

  // Stops reading a worker's output (its read handlers close the pipes).
  static void cancel_pipes(Worker& w) {
    for (Pipe* p : {w.out.get(), w.err.get()}) {
      if (p != nullptr && p->sd.is_open()) p->sd.cancel();
    }
  }

  void arm_drain_timer() {
    drain_timer_.expires_after(kPipeDrainLimit);
    drain_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec || !all_reaped()) return;
      for (const auto& w : workers_) cancel_pipes(*w);
    });
  }

  // Moves on once the group has fully exited: report success, rejoin, fail or exit.
  void advance() {
    if (!group_gone()) return;
    grace_timer_.cancel();
    drain_timer_.cancel();
    unkillable_timer_.cancel();
    if (phase_ == Phase::kRunning) {
      phase_ = Phase::kAwaitingDone;
      v1::AgentMsg msg;
      msg.mutable_success()->set_round(assignment_.round());
      send_report(msg);
      return;
    }
    if (phase_ != Phase::kStopping) return;
    if (!stopped_emitted_) {
      stopped_emitted_ = true;
      if (recovery_) recovery_->stopped = std::chrono::steady_clock::now();
      AgentEvent e = event(AgentEvent::Kind::kWorkersStopped);
      e.workers = static_cast<int>(workers_.size());
      emit(e);
    }
    switch (after_) {
      case After::kNone:
        return;  // the server decides: Restart or Fail
      case After::kRejoin:
        release_workers();
        send_join();
        return;
      case After::kReconnect:
        release_workers();
        after_ = After::kNone;
        reopen_later(&rejoin_deadline_, false);
        return;
      case After::kFail: {
        {
          AgentEvent e = event(AgentEvent::Kind::kFailed);
          e.reason = fail_.reason();
          e.rank = fail_.root_cause().rank();
          e.exit_code = fail_.root_cause().exit_code();
          e.signal = fail_.root_cause().signal();
          emit(e);
        }
        std::vector<v1::WorkerFailure> others(fail_.others().begin(), fail_.others().end());
        std::string summary =
            format_failure_summary(opts_.entrypoint_name, fail_.root_cause(), others);
        write_all(opts_.stderr_fd, summary);
        if (!opts_.python_interpreter.empty()) write_all(opts_.stderr_fd, python_hint());
        if (!opts_.own_error_file.empty()) {
          // As torchrun: launch's own error file names the root cause, for whoever runs it.
          std::ofstream(opts_.own_error_file) << error_file_json(fail_.root_cause());
        }
        if (fail_.do_not_requeue()) {
          spdlog::error("{}; exit code {} (do not requeue)", fail_.reason(), kExitDoNotRequeue);
        }
        finish(fail_.do_not_requeue() ? kExitDoNotRequeue : 1);
        return;
      }
      case After::kExit:
        if (signal_ != 0 && !opts_.own_error_file.empty()) {
          // As torchrun's @record main: the SignalException that stopped it.
          write_signal_exception(opts_.own_error_file, signal_);
        }
        finish(exit_code_);
        return;
    }
  }

  // The ModuleNotFoundError hint for the first of this node's workers whose failure shows one:
  // the root cause when it is ours (its error file), else any worker's stderr tail.
  std::string python_hint() const {
    const v1::WorkerFailure& root = fail_.root_cause();
    if (root.host() == opts_.host && root.group_rank() == assignment_.group_rank()) {
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

  void finish(int code) {
    exit_code_ = code;
    phase_ = Phase::kExiting;
    report_left_behind();
    grace_timer_.cancel();
    drain_timer_.cancel();
    unkillable_timer_.cancel();
    keep_alive_timer_.cancel();
    stop_silence_timer();
    io_.stop();
  }

 public:
  // --- signals ------------------------------------------------------------------------

  void on_signal(int sig) {
    if (phase_ == Phase::kExiting) return;
    if (signal_ != 0) {  // a second signal: no more grace
      signal_groups(SIGKILL);
      if (!all_reaped()) arm_unkillable_timer();
      return;
    }
    signal_ = sig;
    exit_code_ = 128 + sig;
    spdlog::warn("received {}; stopping workers", signal_name(sig));
    after_ = After::kExit;
    client_->close();  // leave the run (or the wait for the server) at once
    stop_silence_timer();
    stop_group(sig);
  }

 private:

  asio::io_context& io_;
  AgentOptions opts_;
  asio::steady_timer grace_timer_;
  asio::steady_timer drain_timer_;
  asio::steady_timer unkillable_timer_;  // after SIGKILL: for workers stuck in the kernel
  asio::steady_timer keep_alive_timer_;
  asio::steady_timer silence_timer_;
  const std::chrono::milliseconds window_;  // the liveness window
  std::chrono::steady_clock::time_point last_heard_{};
  bool silence_armed_ = false;
  bool reached_ = false;  // the server has been heard from (on any stream)
  // After a loss, until the server is heard from again: the node must be back in touch by
  // then, or it exits.
  std::optional<std::chrono::steady_clock::time_point> rejoin_deadline_;
  Endpoints endpoints_;
  // The first wait for a server (wait_for_server), over every endpoint.
  std::optional<std::chrono::steady_clock::time_point> first_deadline_;
  // Re-attach: between the loss of a stream and the server's Attached, the node is not
  // attached (its reports wait); the attempts end at the deadline.
  bool attached_ = true;
  std::optional<std::chrono::steady_clock::time_point> reattach_deadline_;
  std::chrono::steady_clock::time_point reattach_since_{};
  std::optional<v1::AgentMsg> last_report_;
  std::unique_ptr<rendezvous::SessionClient> client_;
  std::unique_ptr<FileTimerServer> file_timers_;
  std::unique_ptr<HangWatch> hang_watch_;  // the run's --hang_timeout
  std::chrono::milliseconds hang_timeout_{0};
  std::optional<Hang> hang_;               // this round's stalled worker, while it is dumped
  std::unique_ptr<StackDump> stack_dump_;
  asio::steady_timer hang_timer_;
  // This attempt's filtered_stdout.log and filtered_stderr.log (-1: no filters, or no file).
  struct OwnedFd {
    int fd = -1;
    void reset() {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
    ~OwnedFd() { reset(); }
  };
  OwnedFd filtered_[2];
  Phase phase_ = Phase::kJoining;
  After after_ = After::kNone;
  v1::Assignment assignment_;
  const std::string host_identity_ = rendezvous::host_identity();
  v1::Fail fail_;
  std::vector<std::unique_ptr<Worker>> workers_;
  // Workers of earlier rounds left behind in the kernel (state D), until they are reaped.
  std::vector<std::unique_ptr<Worker>> abandoned_;
  bool failure_reported_ = false;
  // The recovery under way (agent_events.h), from the first sign the round is over; and
  // whether this round's kWorkersStopped went out.
  std::optional<Recovery> recovery_;
  bool stopped_emitted_ = false;
  int signal_ = 0;
  int exit_code_ = 1;

 public:
  // The run failed and the failure summary was printed (nothing changes after finish()).
  bool failed() const { return phase_ == Phase::kExiting && after_ == After::kFail; }
};

Agent::Agent(asio::io_context& io, AgentOptions options)
    : impl_(std::make_unique<Impl>(io, std::move(options))) {}

Agent::~Agent() = default;

int Agent::run() { return impl_->run(); }

void Agent::on_signal(int sig) { impl_->on_signal(sig); }

bool Agent::failed() const { return impl_->failed(); }

}  // namespace muster::agent
