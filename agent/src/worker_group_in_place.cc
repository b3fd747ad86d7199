// WorkerGroup in place (docs/in_place.md): the workers' control channels, the abort, the
// re-form that replaces only the dead.
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

}  // namespace muster::agent
