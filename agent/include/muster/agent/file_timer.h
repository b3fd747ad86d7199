// torchrun's file-timer watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1), with torch's protocol, so
// torch.distributed.elastic.timer.FileTimerClient and `expires(after=N)` work unchanged.
//
// Workers write one JSON object per line to a FIFO (TORCHELASTIC_TIMER_FILE):
//   {"version": 1, "pid": P, "scope_id": "S", "expiration_time": T, "signal": N}
// T is wall-clock seconds (time.time()); a negative T releases the timer (P, S). When a timer
// expires and its pid is one of this agent's current workers, the agent sends it the signal
// (SIGKILL from FileTimerClient's default), which fails the group as any worker failure does.
// A pid that is not one of the agent's workers is never signalled (torch's server would: here
// a worker cannot make its agent kill an unrelated process); its timers are dropped.
//
// Split in two: FileTimerTable, the pure rules (fake clock in tests), and FileTimerServer, the
// FIFO read on the agent's io_context.
#pragma once

#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::agent {

// Bounds (docs/launch.md, "File timer"): torch's client refuses requests above PIPE_BUF
// (atomic FIFO writes); a longer line here is dropped whole. Timers held at once: a request
// beyond the bound is dropped with a warning.
inline constexpr std::size_t kMaxTimerRequestBytes = 4096;
inline constexpr std::size_t kMaxFileTimers = 65536;

struct TimerRequest {
  pid_t pid = 0;
  std::string scope_id;
  double expiration_time = 0;  // wall-clock seconds; < 0: release
  int signal = 0;
};

// One line of the protocol (without its newline). Unknown keys are ignored, as torch does.
absl::StatusOr<TimerRequest> parse_timer_request(std::string_view line);

using WallTime = std::chrono::system_clock::time_point;

class FileTimerTable {
 public:
  // Acquire (a timer per pid and scope: a second acquire replaces it) or release.
  // Returns false when the table is full and the request was dropped.
  bool apply(const TimerRequest& r);

  struct Expired {
    pid_t pid = 0;
    int signal = 0;                   // of the timer that expired first
    std::vector<std::string> scopes;  // every expired scope of that pid, by expiry
  };
  // Every pid with a timer expired at `now`; their timers (all of the pid's) are removed.
  std::vector<Expired> take_expired(WallTime now);

  // Forget a pid (its worker exited or was replaced).
  void clear(pid_t pid);

  std::optional<WallTime> next_expiry() const;
  std::size_t size() const { return timers_.size(); }

 private:
  struct Timer {
    WallTime at;
    int signal = 0;
  };
  std::map<std::pair<pid_t, std::string>, Timer> timers_;
};

class FileTimerServer {
 public:
  // Called on the io_context for each expired pid.
  using OnExpired = std::function<void(const FileTimerTable::Expired&)>;

  // Makes the FIFO at `path` (which must not exist), and reads it on `io`. The FIFO is
  // removed by the destructor.
  static absl::StatusOr<std::unique_ptr<FileTimerServer>> start(boost::asio::io_context& io,
                                                                 const std::string& path,
                                                                 OnExpired on_expired);
  ~FileTimerServer();
  FileTimerServer(const FileTimerServer&) = delete;
  FileTimerServer& operator=(const FileTimerServer&) = delete;

  const std::string& path() const;
  void clear(pid_t pid);  // a worker that exited: its timers go with it

  class Impl;

 private:
  explicit FileTimerServer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace muster::agent
