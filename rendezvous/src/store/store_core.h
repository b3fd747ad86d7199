// The Store service's request handling without gRPC: StoreServer feeds it requests from its
// streams and delivers the answers; the fuzz target (tests/fuzz/store_fuzz.cc) and unit tests
// drive it directly with their own clock.
//
// Each run is a Run object with its own mutex, its table and an index of the waits parked on
// it (key -> waits missing that key; each wait counts its missing keys), found through a
// small map under a short global lock: runs do not slow each other, and a write wakes only
// the waits of the key it wrote, without copying any wait's key list. Deadlines of parked
// waits sit in one ordered index; the owner calls expire() when next_deadline() comes.
//
// Every parked wait leaves the core exactly once, in one of the lists of answered waits that
// handle / expire / drop / shutdown return, or by a cancel() that returns true. The caller
// then owns delivering its answer (StoreWait::status, and its reply).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "muster/rendezvous/credentials.h"
#include "muster/rendezvous/kv_table.h"
#include "muster/rendezvous/store.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {

using StoreClock = std::chrono::steady_clock;

class StoreCore;

// One request, and, if it must wait, its parked state. The caller keeps `request` and `reply`
// in place until the wait has left the core. A StoreWait parks at most once: make a new one
// for each request.
class StoreWait {
 public:
  StoreWait(const v1::StoreRequest* request, v1::StoreReply* reply)
      : request(request), reply(reply) {}
  virtual ~StoreWait() = default;

  const v1::StoreRequest* const request;
  v1::StoreReply* const reply;
  // The answer of a wait that has left the core (set before it is handed back).
  absl::Status status;

 private:
  friend class StoreCore;
  using Waiting = std::list<std::pair<StoreWait*, std::uint32_t>>;
  using KeyNode = std::pair<const std::string, Waiting>;
  struct Slot {
    KeyNode* node;
    Waiting::iterator pos;
    bool live;
  };
  // All below are guarded by the run's mutex; `run` and `timer_pos` are written under both it
  // and StoreCore::timer_mu_ (cancel() reads `run` under timer_mu_ alone).
  bool parked = false;
  std::shared_ptr<void> run;  // the StoreCore::Run it is parked on
  std::size_t missing = 0;
  std::vector<Slot> slots;
  StoreClock::time_point deadline;
  std::multimap<StoreClock::time_point, std::shared_ptr<StoreWait>>::iterator timer_pos;
};

using StoreWaitPtr = std::shared_ptr<StoreWait>;

class StoreCore {
 public:
  struct Options {
    StoreLimits limits;
    // A request's token must open its run (credentials.h): run A's token on run B's table is
    // PERMISSION_DENIED. Null: every request is let through (tests, the fuzz target).
    std::shared_ptr<const Credentials> credentials;
    // Refuse requests for runs not opened with open_run() (FAILED_PRECONDITION).
    bool require_open_runs = true;
  };
  struct RunStats {
    std::size_t keys = 0;
    std::size_t bytes = 0;
    std::size_t parked = 0;        // waits parked on the run
    std::size_t indexed_keys = 0;  // distinct keys some wait misses
    std::uint64_t wait_visits = 0;  // times a write looked at one of the run's waits
  };

  explicit StoreCore(Options options);
  ~StoreCore();

  // Serves w->request into w->reply. Returns the answer, or nullopt when the wait was parked
  // (it comes back later). `woken` gets the waits this request completed.
  std::optional<absl::Status> handle(const StoreWaitPtr& w, StoreClock::time_point now,
                                     std::vector<StoreWaitPtr>& woken);
  // Takes a parked wait out (its client went, or it timed out by the caller's clock) and
  // sets its status to `why`. False when it was not parked (answered or never parked).
  bool cancel(StoreWait& w, absl::Status why);
  // The parked waits whose deadline is at or before `now`, out, with DEADLINE_EXCEEDED.
  std::vector<StoreWaitPtr> expire(StoreClock::time_point now);
  std::optional<StoreClock::time_point> next_deadline() const;
  // Called (with the core's locks held: it must only signal) when a wait parks with a
  // deadline earlier than every other one.
  void set_on_earlier_deadline(std::function<void()> f) { on_earlier_deadline_ = std::move(f); }

  void open_run(const std::string& run_id);
  // Ends the run: its table goes and its parked waits come back with FAILED_PRECONDITION.
  std::vector<StoreWaitPtr> drop(const std::string& run_id);
  // Every parked wait comes back with UNAVAILABLE; later requests get the same.
  std::vector<StoreWaitPtr> shutdown();
  bool shutting_down() const;

  std::size_t parked_waits() const { return parked_.load(std::memory_order_relaxed); }
  // Requests handled, by v1::StoreRequest::Op (an unknown op counts as OP_UNSPECIFIED), for
  // the metrics.
  static constexpr int kNumOps = v1::StoreRequest::Op_ARRAYSIZE;
  std::uint64_t op_count(int op) const { return op_counts_[op].load(std::memory_order_relaxed); }
  std::optional<RunStats> stats(const std::string& run_id) const;
  const StoreLimits& limits() const { return options_.limits; }

  static absl::Status unavailable() {
    return absl::UnavailableError("store: the server is shutting down");
  }

 private:
  struct Run {
    explicit Run(const StoreLimits& limits) : table(limits) {}
    absl::Mutex mu;
    KvTable table ABSL_GUARDED_BY(mu);
    // key -> the waits missing it (with each one's slot for that key).
    std::unordered_map<std::string, StoreWait::Waiting> waiting ABSL_GUARDED_BY(mu);
    std::size_t parked ABSL_GUARDED_BY(mu) = 0;
    std::uint64_t wait_visits ABSL_GUARDED_BY(mu) = 0;
    bool dropped ABSL_GUARDED_BY(mu) = false;  // by drop() or shutdown(): serves nothing more
  };

  absl::Status validate(const v1::StoreRequest& req) const;
  std::shared_ptr<Run> find_run(const std::string& run_id, absl::Status& st);
  // The waits of `key` no longer miss it; those missing nothing more are answered.
  void wake(Run& run, const std::string& key, std::vector<StoreWaitPtr>& woken)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu);
  // Indexes w's missing keys; false if none is missing.
  bool index(Run& run, StoreWait& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu);
  void unindex(Run& run, StoreWait& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu);
  // Fills the reply of a read whose keys are all present.
  static absl::Status answer_read(const KvTable& table, const v1::StoreRequest& req,
                                  v1::StoreReply& reply);
  void park(const std::shared_ptr<Run>& run, const StoreWaitPtr& w, StoreClock::time_point now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run->mu);
  // Takes w out of the core.
  void unpark(Run& run, StoreWait& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu);

  const Options options_;
  std::function<void()> on_earlier_deadline_;
  std::atomic<std::size_t> parked_{0};
  std::array<std::atomic<std::uint64_t>, kNumOps> op_counts_{};

  mutable absl::Mutex runs_mu_;
  std::unordered_map<std::string, std::shared_ptr<Run>> runs_ ABSL_GUARDED_BY(runs_mu_);
  bool shutting_down_ ABSL_GUARDED_BY(runs_mu_) = false;

  // Lock order: a run's mu, then timer_mu_.
  mutable absl::Mutex timer_mu_;
  std::multimap<StoreClock::time_point, StoreWaitPtr> timers_ ABSL_GUARDED_BY(timer_mu_);
};

}  // namespace muster::rendezvous
