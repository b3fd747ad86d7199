// --hang_timeout (docs/hangs.md): the agent's side of the progress pages (ops/progress_page.h).
//
// HangWatch creates one page per worker, maps them, reads them on a timer and hands what they
// say (each rank's position and how long it has been still) to `on_sample`: the agent sends it
// to the rendezvous server, which applies the stall rule (rendezvous/stall.h) over every
// node's ranks and tells the node of a stalled rank (Stalled). StackDump writes a
// stalled worker's stacks to a file without blocking the agent's loop: gdb's batch backtrace of
// every thread when gdb is on PATH (run as a child, bounded), else the kernel's view
// (/proc/PID/task/*/stack, wchan, state). A Python worker's own tracebacks come from
// faulthandler (PYTHONFAULTHANDLER=1 and SIGABRT): the agent handles that, since they arrive on
// the worker's stderr.
#pragma once

#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "muster/rendezvous/stall.h"

namespace muster::agent {

class HangWatch {
 public:
  struct Watched {
    int rank = 0;
    int local_rank = 0;
    pid_t pid = -1;
    std::string page;  // the page's path (create_page made it)
  };
  using Sample = std::function<void(const std::vector<rendezvous::RankProgress>&,
                                    rendezvous::StallClock::time_point now)>;
  // Samples every quarter of `timeout` (at least 50 ms, at most 1 s).
  HangWatch(boost::asio::io_context& io, std::chrono::milliseconds timeout, Sample on_sample);
  ~HangWatch();

  // A fresh page at `path` (kProgressPageBytes, magic and version set), for a worker's
  // MUSTER_PROGRESS_FILE.
  static absl::Status create_page(const std::string& path);

  // Watches a new round's workers (their pages made by create_page); forgets the last round.
  void start_round(const std::vector<Watched>& workers);
  // Stops watching (the group is stopping).
  void stop();

 private:
  void arm();
  void check();

  std::chrono::milliseconds timeout_;
  Sample on_sample_;
  boost::asio::steady_timer timer_;
  std::vector<void*> maps_;  // one per watched worker, in ranks' order
  rendezvous::ProgressTracker tracker_;
  bool active_ = false;
};

// Writes the stacks of `pid` to `path`, then calls `done(what)` on the loop, `what` saying how
// they were taken ("gdb", "/proc"). At most `budget` (gdb is then killed; what it wrote stays).
class StackDump {
 public:
  // `gdb`: its path (found once by the caller), or empty: the kernel's view only.
  static std::unique_ptr<StackDump> start(boost::asio::io_context& io, pid_t pid,
                                          const std::string& path, std::chrono::milliseconds budget,
                                          const std::string& gdb,
                                          std::function<void(const std::string&)> done);
  ~StackDump();

 private:
  StackDump(boost::asio::io_context& io) : timer_(io) {}
  void finish();
  pid_t gdb_ = -1;
  std::unique_ptr<boost::asio::posix::stream_descriptor> pidfd_;
  boost::asio::steady_timer timer_;
  std::function<void(const std::string&)> done_;
  std::string what_;
  std::string path_;
  pid_t target_ = -1;
  bool finished_ = false;
};

// The kernel's view of `pid`'s threads (state, wchan, kernel stack) as text, for the stack file
// and for a worker that does not die (state D).
std::string kernel_stacks(pid_t pid);

}  // namespace muster::agent
