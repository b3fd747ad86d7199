// WorkerGroup's stalled workers (--hang_timeout: their stacks), file timers, and the hint for
// a Python worker's failure.
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
