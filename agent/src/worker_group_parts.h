// What worker_group*.cc share and nothing else includes: a worker's record, its output
// pipes, the group's timers, and the helpers the rooms of the group use (worker_group.cc:
// start, output, exits, stop; worker_group_in_place.cc: the control channel and the re-form;
// worker_group_spares.cc: warm spares; worker_group_hangs.cc: stalled workers' stacks).
#pragma once

#include <sys/types.h>

#include <array>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "muster/agent/line_splitter.h"
#include "muster/agent/proc_state.h"
#include "muster/agent/worker_group.h"
#include "muster/ops/control_channel.h"

namespace muster::agent {
namespace worker_group_internal {

using Descriptor = boost::asio::posix::stream_descriptor;


// Once every worker is reaped and its group killed, a pipe still open belongs to a process
// that left the group; stop waiting for it after this long.
constexpr auto kPipeDrainLimit = std::chrono::seconds(2);
// Lines of a stuck worker's kernel stack in its warning (the whole view is kernel_stacks').
constexpr int kStuckStackLines = 8;
// Without a hang timeout (only a budget that knows progress), a progress sample every
// quarter of this.
constexpr auto kProgressOnlySampling = std::chrono::milliseconds(4000);

// Milliseconds since the epoch (a failure's timestamp).
std::int64_t wall_ms();
// --numa_binding for a spare that takes a local rank: every thread it has now (the ones it
// starts later inherit). Its memory stays where it was allocated.
void bind_cpus(pid_t pid, const std::set<int>& cpus);
// Every thread of `pid` to nice `value` (the ones it starts later inherit from theirs).
void set_nice(pid_t pid, int value);
// A worker's log file, truncated (-1, said once on the log, where it cannot be written).
int open_log(const std::string& path);

}  // namespace worker_group_internal

// One worker output stream: to the console (whole prefixed lines; -1: not shown) and/or to a
// log file (raw; -1: none).
struct WorkerGroup::Pipe {
  Pipe(boost::asio::io_context& io, int fd, std::string prefix, int console, int file)
      : sd(io, fd), splitter(std::move(prefix)), console(console), file(file) {}
  ~Pipe() {
    if (file >= 0) ::close(file);
  }
  worker_group_internal::Descriptor sd;
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
  std::unique_ptr<worker_group_internal::Descriptor> pidfd;
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
  std::unique_ptr<worker_group_internal::Descriptor> control;
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
  explicit Timers(boost::asio::io_context& io)
      : grace(io), drain(io), unkillable(io), hang(io), warm(io) {}
  void cancel() {
    grace.cancel();
    drain.cancel();
    unkillable.cancel();
  }
  boost::asio::steady_timer grace;       // SIGKILL after the shutdown grace
  boost::asio::steady_timer drain;       // pipes held open by a process that left the group
  boost::asio::steady_timer unkillable;  // after SIGKILL: for workers stuck in the kernel
  boost::asio::steady_timer hang;        // a Python worker's faulthandler dump
  boost::asio::steady_timer warm;        // --spares: the first workers' warm-up (not in cancel())
};

}  // namespace muster::agent
