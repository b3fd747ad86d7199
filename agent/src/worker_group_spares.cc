// WorkerGroup's warm spares (--spares; docs/in_place_torch.md, "Warm spares"): started once
// the program asks, handed a dead rank with take.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "muster/agent/failure.h"
#include "muster/agent/process.h"
#include "muster/agent/worker_group.h"
#include "muster/ops/control_channel.h"
#include "muster/ops/progress_page.h"
#include "muster/ops/worker_env_names.h"
#include "muster/rendezvous/limits.h"
#include "worker_group_parts.h"

namespace muster::agent {

namespace asio = boost::asio;
namespace limits = muster::rendezvous::limits;
using namespace worker_group_internal;

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

}  // namespace muster::agent
