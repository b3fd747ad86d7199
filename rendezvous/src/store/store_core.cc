#include "store/store_core.h"

#include "muster/ops/text.h"

#include <malloc.h>

#include <algorithm>
#include <string_view>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace muster::rendezvous {

namespace {
using R = v1::StoreRequest;

// Dropping a table at least this large returns freed memory to the OS (malloc_trim), so
// rdzvd shrinks back after large runs; smaller ones are not worth the call.
constexpr std::size_t kTrimAfterBytes = 1 << 20;
}  // namespace



StoreCore::StoreCore(Options options) : options_(std::move(options)) {}

StoreCore::~StoreCore() = default;

absl::Status StoreCore::validate(const v1::StoreRequest& req) const {
  // First, before anything of the request is looked at: the run it names selects the token
  // it needs (compared in constant time).
  if (options_.credentials && !options_.credentials->allows(req.run_id(), req.token())) {
    return absl::PermissionDeniedError(
        "store refused the call: wrong or missing token for this run");
  }
  const int nkeys = req.keys_size();
  const int nvalues = req.values_size();
  bool shape_ok = true;
  switch (req.op()) {
    case R::SET: shape_ok = nkeys == 1 && nvalues == 1; break;
    case R::GET: case R::ADD: case R::DELETE: shape_ok = nkeys == 1 && nvalues == 0; break;
    case R::COMPARE_SET: shape_ok = nkeys == 1 && nvalues == 2; break;
    case R::CHECK: case R::WAIT: case R::MULTI_GET: shape_ok = nkeys >= 1 && nvalues == 0; break;
    case R::NUM_KEYS: shape_ok = nkeys == 0 && nvalues == 0; break;
    case R::MULTI_SET: shape_ok = nkeys == nvalues; break;
    default: shape_ok = false;
  }
  if (!shape_ok || req.run_id().empty() || req.run_id().size() > limits::kMaxIdBytes) {
    return absl::InvalidArgumentError("store: malformed request");
  }
  if (!ops::is_valid_utf8(req.run_id())) {
    return absl::InvalidArgumentError("store: the run id is not valid UTF-8");
  }
  return absl::OkStatus();
}

std::shared_ptr<StoreCore::Run> StoreCore::find_run(const std::string& run_id, absl::Status& st) {
  {
    absl::ReaderMutexLock lock(&runs_mu_);
    if (shutting_down_) {
      st = unavailable();
      return nullptr;
    }
    auto it = runs_.find(run_id);
    if (it != runs_.end()) return it->second;
    if (options_.require_open_runs) {
      st = absl::FailedPreconditionError(absl::StrCat("store: unknown run '", run_id, "'"));
      return nullptr;
    }
  }
  absl::MutexLock lock(&runs_mu_);
  if (shutting_down_) {
    st = unavailable();
    return nullptr;
  }
  auto& run = runs_[run_id];
  if (!run) run = std::make_shared<Run>(options_.limits);
  return run;
}

absl::Status StoreCore::answer_read(const KvTable& table, const v1::StoreRequest& req,
                                    v1::StoreReply& reply) {
  if (req.op() == R::WAIT) return absl::OkStatus();
  const auto key = [&](std::size_t i) -> const std::string& { return req.keys(static_cast<int>(i)); };
  if (absl::Status s = table.check_reply(req.keys_size(), key); !s.ok()) return s;
  for (const auto& k : req.keys()) reply.add_values(*table.find(k));
  return absl::OkStatus();
}

std::optional<absl::Status> StoreCore::handle(const StoreWaitPtr& w, StoreClock::time_point now,
                                              std::vector<StoreWaitPtr>& woken) {
  const v1::StoreRequest& req = *w->request;
  v1::StoreReply& reply = *w->reply;
  const int op = req.op() >= 0 && req.op() < kNumOps ? req.op() : R::OP_UNSPECIFIED;
  op_counts_[op].fetch_add(1, std::memory_order_relaxed);
  if (absl::Status st = validate(req); !st.ok()) return st;
  absl::Status st;
  std::shared_ptr<Run> run = find_run(req.run_id(), st);
  if (!run) return st;
  absl::MutexLock lock(&run->mu);
  if (run->dropped) {
    // drop() or shutdown() came between the lookup and the lock.
    if (shutting_down()) return unavailable();
    return absl::FailedPreconditionError(absl::StrCat("store: unknown run '", req.run_id(), "'"));
  }
  KvTable& table = run->table;
  const auto key = [&](std::size_t i) -> const std::string& { return req.keys(static_cast<int>(i)); };
  const auto value = [&](std::size_t i) -> const std::string& {
    return req.values(static_cast<int>(i));
  };
  if (st = table.check_keys(req.keys_size(), key); !st.ok()) return st;
  switch (req.op()) {
    case R::SET:
      st = table.set(req.keys(0), req.values(0));
      if (st.ok()) wake(*run, req.keys(0), woken);
      return st;
    case R::ADD: {
      auto v = table.add(req.keys(0), req.delta());
      if (!v.ok()) return v.status();
      reply.set_number(*v);
      wake(*run, req.keys(0), woken);
      return absl::OkStatus();
    }
    case R::COMPARE_SET: {
      auto v = table.compare_set(req.keys(0), req.values(0), req.values(1));
      if (!v.ok()) return v.status();
      reply.add_values(*v);
      wake(*run, req.keys(0), woken);  // a no-op when nothing was created
      return absl::OkStatus();
    }
    case R::DELETE:
      reply.set_flag(table.erase(req.keys(0)));
      return absl::OkStatus();
    case R::CHECK:
      reply.set_flag(table.contains_all(req.keys_size(), key));
      return absl::OkStatus();
    case R::NUM_KEYS:
      reply.set_number(static_cast<std::int64_t>(table.size()));
      return absl::OkStatus();
    case R::MULTI_SET:
      st = table.multi_set(req.keys_size(), key, value);
      if (st.ok()) {
        for (const auto& k : req.keys()) wake(*run, k, woken);
      }
      return st;
    default:  // GET, WAIT, MULTI_GET (validate() let nothing else through)
      break;
  }
  if (table.contains_all(req.keys_size(), key)) return answer_read(table, req, reply);
  park(run, w, now);
  return std::nullopt;
}

bool StoreCore::index(Run& run, StoreWait& w) {
  const v1::StoreRequest& req = *w.request;
  std::unordered_set<std::string_view> seen;
  for (const auto& k : req.keys()) {
    if (run.table.find(k) != nullptr) continue;
    if (req.keys_size() > 1 && !seen.insert(k).second) continue;  // named twice
    auto [it, fresh] = run.waiting.try_emplace(k);
    (void)fresh;
    const auto slot = static_cast<std::uint32_t>(w.slots.size());
    auto pos = it->second.insert(it->second.end(), {&w, slot});
    w.slots.push_back({&*it, pos, true});
    ++w.missing;
  }
  return w.missing > 0;
}

void StoreCore::unindex(Run& run, StoreWait& w) {
  for (StoreWait::Slot& s : w.slots) {
    if (!s.live) continue;
    s.node->second.erase(s.pos);
    if (s.node->second.empty()) run.waiting.erase(s.node->first);
  }
  w.slots.clear();
  w.missing = 0;
}

void StoreCore::park(const std::shared_ptr<Run>& run, const StoreWaitPtr& w,
                     StoreClock::time_point now) {
  // A negative timeout is 0; a longer one than max_wait is clamped (saturating: no overflow).
  const std::int64_t max_ms = options_.limits.max_wait.count();
  const std::int64_t ms = std::clamp<std::int64_t>(w->request->timeout_ms(), 0, max_ms);
  w->deadline = now + std::chrono::milliseconds(ms);
  index(*run, *w);
  w->parked = true;
  ++run->parked;
  parked_.fetch_add(1, std::memory_order_relaxed);
  bool earliest = false;
  {
    absl::MutexLock lock(&timer_mu_);
    w->run = run;
    w->timer_pos = timers_.emplace(w->deadline, w);
    earliest = w->timer_pos == timers_.begin();
  }
  if (earliest && on_earlier_deadline_) on_earlier_deadline_();
}

void StoreCore::unpark(Run& run, StoreWait& w) {
  unindex(run, w);
  w.parked = false;
  --run.parked;
  parked_.fetch_sub(1, std::memory_order_relaxed);
  StoreWaitPtr self;  // the timer index's reference: released after the locks
  {
    absl::MutexLock lock(&timer_mu_);
    self = std::move(w.timer_pos->second);
    timers_.erase(w.timer_pos);
    w.run.reset();
  }
}

void StoreCore::wake(Run& run, const std::string& key, std::vector<StoreWaitPtr>& woken) {
  auto it = run.waiting.find(key);
  if (it == run.waiting.end()) return;
  StoreWait::Waiting list = std::move(it->second);
  run.waiting.erase(it);
  for (auto& [w, slot] : list) {
    ++run.wait_visits;
    w->slots[slot].live = false;
    if (--w->missing > 0) continue;
    // Every key was seen once; a key deleted since then is missing again.
    w->slots.clear();
    if (index(run, *w)) continue;
    StoreWaitPtr keep = w->timer_pos->second;
    w->status = answer_read(run.table, *w->request, *w->reply);
    unpark(run, *w);
    woken.push_back(std::move(keep));
  }
}

bool StoreCore::cancel(StoreWait& w, absl::Status why) {
  std::shared_ptr<Run> run;
  {
    // w.run is written under the run's own mutex, which we do not know yet; the timer index
    // (under timer_mu_) holds the wait while it is parked, so read the run from there.
    absl::MutexLock lock(&timer_mu_);
    if (!w.run) return false;
    run = std::static_pointer_cast<Run>(w.run);
  }
  absl::MutexLock lock(&run->mu);
  // A StoreWait parks at most once, so parked here means parked on `run`.
  if (!w.parked) return false;
  w.status = std::move(why);
  StoreWaitPtr keep = w.timer_pos->second;
  unpark(*run, w);
  return true;
}

std::vector<StoreWaitPtr> StoreCore::expire(StoreClock::time_point now) {
  std::vector<StoreWaitPtr> due;
  {
    absl::MutexLock lock(&timer_mu_);
    for (auto it = timers_.begin(); it != timers_.end() && it->first <= now; ++it) {
      due.push_back(it->second);
    }
  }
  std::vector<StoreWaitPtr> out;
  for (StoreWaitPtr& w : due) {
    const v1::StoreRequest& req = *w->request;
    if (cancel(*w, absl::DeadlineExceededError(absl::StrCat(
                       "store: timed out after ",
                       std::clamp<std::int64_t>(req.timeout_ms(), 0,
                                                options_.limits.max_wait.count()),
                       " ms waiting for ", req.keys_size(), " key(s)")))) {
      out.push_back(std::move(w));
    }
  }
  return out;
}

std::optional<StoreClock::time_point> StoreCore::next_deadline() const {
  absl::MutexLock lock(&timer_mu_);
  if (timers_.empty()) return std::nullopt;
  return timers_.begin()->first;
}

void StoreCore::open_run(const std::string& run_id) {
  absl::MutexLock lock(&runs_mu_);
  auto& run = runs_[run_id];
  if (!run) run = std::make_shared<Run>(options_.limits);
}

std::vector<StoreWaitPtr> StoreCore::drop(const std::string& run_id) {
  std::shared_ptr<Run> run;
  {
    absl::MutexLock lock(&runs_mu_);
    auto it = runs_.find(run_id);
    if (it == runs_.end()) return {};
    run = std::move(it->second);
    runs_.erase(it);
  }
  std::vector<StoreWaitPtr> out;
  KvTable gone(options_.limits);
  {
    absl::MutexLock lock(&run->mu);
    run->dropped = true;
    std::vector<StoreWait*> parked;
    for (auto& [key, list] : run->waiting) {
      for (auto& [w, slot] : list) parked.push_back(w);  // each parked wait misses a key
    }
    std::sort(parked.begin(), parked.end());
    parked.erase(std::unique(parked.begin(), parked.end()), parked.end());
    for (StoreWait* w : parked) {
      StoreWaitPtr keep = w->timer_pos->second;
      w->status = absl::FailedPreconditionError(
          absl::StrCat("store: run '", run_id, "' has ended"));
      unpark(*run, *w);
      out.push_back(std::move(keep));
    }
    std::swap(gone, run->table);
  }
  const bool trim = gone.bytes() >= kTrimAfterBytes;
  gone = KvTable(options_.limits);  // frees the table outside the locks
  if (trim) ::malloc_trim(0);
  return out;
}

std::vector<StoreWaitPtr> StoreCore::shutdown() {
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&runs_mu_);
    shutting_down_ = true;
    for (const auto& [id, run] : runs_) ids.push_back(id);
  }
  std::vector<StoreWaitPtr> out;
  for (const std::string& id : ids) {
    for (StoreWaitPtr& w : drop(id)) {
      w->status = unavailable();
      out.push_back(std::move(w));
    }
  }
  return out;
}

bool StoreCore::shutting_down() const {
  absl::ReaderMutexLock lock(&runs_mu_);
  return shutting_down_;
}

std::optional<StoreCore::RunStats> StoreCore::stats(const std::string& run_id) const {
  std::shared_ptr<Run> run;
  {
    absl::ReaderMutexLock lock(&runs_mu_);
    auto it = runs_.find(run_id);
    if (it == runs_.end()) return std::nullopt;
    run = it->second;
  }
  absl::MutexLock lock(&run->mu);
  RunStats s;
  s.keys = run->table.size();
  s.bytes = run->table.bytes();
  s.parked = run->parked;
  s.indexed_keys = run->waiting.size();
  s.wait_visits = run->wait_visits;
  return s;
}

}  // namespace muster::rendezvous
