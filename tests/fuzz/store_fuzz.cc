// libFuzzer target: the Store service's request handling (StoreCore, no gRPC). The input is a
// stream of requests over a few runs (every op, odd shapes, huge and negative timeouts and
// deltas, keys and values at and over the limits), drops and re-opens of runs, cancels of
// parked waits, and clock steps. A model of each run's table checks, with abort():
// - a table never exceeds its key and byte limits, and its counts match the model;
// - a refused request changes nothing;
// - a read answered OK returns the values last set; CHECK / DELETE / NUM_KEYS agree;
// - every parked wait is answered exactly once (or cancelled), and none is left at the end.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "../../rendezvous/src/store/store_core.h"

using muster::rendezvous::StoreClock;
using muster::rendezvous::StoreCore;
using muster::rendezvous::StoreLimits;
using muster::rendezvous::StoreWait;
using muster::rendezvous::StoreWaitPtr;
using muster::v1::StoreReply;
using muster::v1::StoreRequest;

namespace {

#define CHECK_OR_DIE(cond)                                                   \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "store_fuzz: invariant failed: %s (line %d)\n", #cond, __LINE__); \
      std::abort();                                                          \
    }                                                                        \
  } while (0)

struct Reader {
  const std::uint8_t* p;
  std::size_t n;
  bool empty() const { return n == 0; }
  std::uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  std::int64_t i64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | byte();
    return static_cast<std::int64_t>(v);
  }
};

StoreLimits fuzz_limits() {
  StoreLimits l;
  l.max_key_bytes = 16;
  l.max_value_bytes = 64;
  l.max_keys = 8;
  l.max_bytes = 200;
  l.max_keys_per_request = 6;
  l.max_message_bytes = 150;
  l.max_wait = std::chrono::hours(1);
  return l;
}

struct Call : StoreWait {
  StoreRequest req;
  StoreReply rep;
  Call() : StoreWait(&req, &rep) {}
};

const char* const kRuns[] = {"r0", "r1", "r2", "r\xff"};  // the last is not UTF-8
constexpr int kRunCount = 3;                               // the valid ones

struct Model {
  std::map<std::string, std::string> kv;
  bool open = false;
  std::size_t bytes() const {
    std::size_t b = 0;
    for (const auto& [k, v] : kv) b += k.size() + v.size();
    return b;
  }
};

class Harness {
 public:
  Harness() : core_(StoreCore::Options{fuzz_limits(), nullptr, true}), now_(StoreClock::time_point{}) {
    for (int i = 0; i < kRunCount; ++i) open(i);
  }

  void step(Reader& in) {
    const std::uint8_t op = in.byte();
    switch (op % 16) {
      case 11: drop(in.byte() % kRunCount); return;
      case 12: open(in.byte() % kRunCount); return;
      case 13: cancel(in.byte()); return;
      case 14: advance(in); return;
      default: request(in, static_cast<StoreRequest::Op>(op % 11)); return;
    }
  }

  void finish() {
    answered(core_.shutdown(), /*by_write=*/false);
    CHECK_OR_DIE(parked_.empty());
    CHECK_OR_DIE(core_.parked_waits() == 0);
    CHECK_OR_DIE(!core_.next_deadline().has_value());
  }

 private:
  std::string key(Reader& in) {
    const std::uint8_t b = in.byte();
    const auto& l = core_.limits();
    switch (b >> 5) {
      case 0: return std::string(l.max_key_bytes, static_cast<char>('a' + (b & 3)));  // at the limit
      case 1: return std::string(l.max_key_bytes + 1, 'k');                           // over it
      case 2: return std::string(1, static_cast<char>(b));                            // any byte
      default: return "k" + std::to_string(b & 7);
    }
  }
  std::string value(Reader& in) {
    const std::uint8_t b = in.byte();
    const auto& l = core_.limits();
    switch (b >> 5) {
      case 0: return std::string(l.max_value_bytes, 'v');
      case 1: return std::string(l.max_value_bytes + 1, 'v');
      case 2: return std::to_string(static_cast<std::int8_t>(b));  // a number, for ADD
      case 3: return "";
      case 4: return std::string(40, static_cast<char>(b));
      default: return std::string(1 + (b & 7), 'x');
    }
  }
  std::int64_t number(Reader& in) {
    static constexpr std::int64_t kEdges[] = {0, 1, -1, 10,
                                              std::numeric_limits<std::int64_t>::max(),
                                              std::numeric_limits<std::int64_t>::min(),
                                              std::numeric_limits<std::int64_t>::max() - 1};
    const std::uint8_t b = in.byte();
    if (b < 7 * 32) return kEdges[b % 7];
    return in.i64();
  }

  void open(int run) {
    core_.open_run(kRuns[run]);
    models_[run].open = true;  // a table that was open stays as it is
  }

  void drop(int run) {
    auto out = core_.drop(kRuns[run]);
    for (const auto& w : out) {
      CHECK_OR_DIE(w->status.code() == absl::StatusCode::kFailedPrecondition);
    }
    answered(out, false);
    models_[run] = Model{};
    CHECK_OR_DIE(!core_.stats(kRuns[run]).has_value());
  }

  void cancel(std::uint8_t which) {
    if (parked_.empty()) {
      // A wait never parked, or already answered, is not cancelled.
      Call c;
      CHECK_OR_DIE(!core_.cancel(c, absl::CancelledError("x")));
      return;
    }
    auto it = parked_.begin();
    std::advance(it, which % parked_.size());
    std::shared_ptr<Call> w = it->first;
    CHECK_OR_DIE(core_.cancel(*w, absl::CancelledError("gone")));
    parked_.erase(it);
    CHECK_OR_DIE(!core_.cancel(*w, absl::CancelledError("twice")));
    check_parked_count();
  }

  void advance(Reader& in) {
    const std::uint8_t b = in.byte();
    now_ += b < 128 ? std::chrono::milliseconds(b) : std::chrono::minutes(b);
    auto out = core_.expire(now_);
    for (const auto& w : out) {
      CHECK_OR_DIE(w->status.code() == absl::StatusCode::kDeadlineExceeded);
      auto it = parked_.find(std::static_pointer_cast<Call>(w));
      CHECK_OR_DIE(it != parked_.end() && it->second <= now_);
    }
    answered(out, false);
    if (auto next = core_.next_deadline()) CHECK_OR_DIE(*next > now_);
  }

  void request(Reader& in, StoreRequest::Op op) {
    auto c = std::make_shared<Call>();
    StoreRequest& req = c->req;
    const std::uint8_t shape = in.byte();
    const int run = shape & 3;  // 3: the invalid UTF-8 id
    req.set_run_id(kRuns[run]);
    req.set_op(op);
    const std::uint8_t counts = in.byte();
    int nkeys = counts & 7;
    int nvalues = (counts >> 3) & 7;
    if (counts & 0x40) {  // the shape the op expects
      switch (op) {
        case StoreRequest::SET: nkeys = 1; nvalues = 1; break;
        case StoreRequest::COMPARE_SET: nkeys = 1; nvalues = 2; break;
        case StoreRequest::MULTI_SET: nvalues = nkeys; break;
        case StoreRequest::NUM_KEYS: nkeys = 0; nvalues = 0; break;
        case StoreRequest::GET: case StoreRequest::ADD: case StoreRequest::DELETE:
          nkeys = 1; nvalues = 0; break;
        default: nkeys = nkeys == 0 ? 1 : nkeys; nvalues = 0; break;
      }
    }
    for (int i = 0; i < nkeys; ++i) req.add_keys(key(in));
    for (int i = 0; i < nvalues; ++i) req.add_values(value(in));
    req.set_delta(number(in));
    req.set_timeout_ms(number(in));

    const bool valid_run = run < kRunCount;
    std::vector<StoreWaitPtr> woken;
    std::optional<absl::Status> st = core_.handle(c, now_, woken);
    if (!st) {
      CHECK_OR_DIE(valid_run && models_[run].open);
      CHECK_OR_DIE(woken.empty());
      CHECK_OR_DIE(op == StoreRequest::GET || op == StoreRequest::WAIT ||
                   op == StoreRequest::MULTI_GET);
      CHECK_OR_DIE(!all_present(models_[run], req));
      const std::int64_t ms = std::clamp<std::int64_t>(
          req.timeout_ms(), 0, core_.limits().max_wait.count());
      parked_.emplace(c, now_ + std::chrono::milliseconds(ms));
      check_parked_count();
      return;
    }
    if (!valid_run) CHECK_OR_DIE(st->code() == absl::StatusCode::kInvalidArgument);
    if (valid_run && !models_[run].open && st->ok()) CHECK_OR_DIE(false);
    if (!st->ok()) {
      CHECK_OR_DIE(woken.empty());
      if (valid_run) check_table(run);  // nothing changed
      return;
    }
    apply(run, *c);
    check_table(run);
    answered(woken, true);
  }

  static bool all_present(const Model& m, const StoreRequest& req) {
    for (const auto& k : req.keys()) {
      if (m.kv.count(k) == 0) return false;
    }
    return true;
  }

  // Applies a successful request to the model and checks its reply.
  void apply(int run, const Call& c) {
    Model& m = models_[run];
    const StoreRequest& req = c.req;
    const StoreReply& rep = c.rep;
    switch (req.op()) {
      case StoreRequest::SET: m.kv[req.keys(0)] = req.values(0); break;
      case StoreRequest::ADD: {
        std::int64_t cur = 0;
        auto it = m.kv.find(req.keys(0));
        if (it != m.kv.end()) CHECK_OR_DIE(absl::SimpleAtoi(it->second, &cur));
        std::int64_t sum = 0;
        CHECK_OR_DIE(!__builtin_add_overflow(cur, req.delta(), &sum));
        CHECK_OR_DIE(rep.number() == sum);
        m.kv[req.keys(0)] = std::to_string(sum);
        break;
      }
      case StoreRequest::COMPARE_SET: {
        auto it = m.kv.find(req.keys(0));
        CHECK_OR_DIE(rep.values_size() == 1);
        if (it != m.kv.end()) {
          CHECK_OR_DIE(rep.values(0) == (it->second == req.values(0) ? req.values(1) : it->second));
          it->second = rep.values(0);
        } else if (req.values(0).empty()) {
          CHECK_OR_DIE(rep.values(0) == req.values(1));
          m.kv[req.keys(0)] = req.values(1);
        } else {
          CHECK_OR_DIE(rep.values(0) == req.values(0));
        }
        break;
      }
      case StoreRequest::DELETE: CHECK_OR_DIE(rep.flag() == (m.kv.erase(req.keys(0)) > 0)); break;
      case StoreRequest::CHECK: CHECK_OR_DIE(rep.flag() == all_present(m, req)); break;
      case StoreRequest::NUM_KEYS:
        CHECK_OR_DIE(rep.number() == static_cast<std::int64_t>(m.kv.size()));
        break;
      case StoreRequest::MULTI_SET:
        for (int i = 0; i < req.keys_size(); ++i) m.kv[req.keys(i)] = req.values(i);
        break;
      default: check_read(m, c); break;
    }
  }

  static void check_read(const Model& m, const Call& c) {
    CHECK_OR_DIE(all_present(m, c.req));
    if (c.req.op() == StoreRequest::WAIT) {
      CHECK_OR_DIE(c.rep.values_size() == 0);
      return;
    }
    CHECK_OR_DIE(c.rep.values_size() == c.req.keys_size());
    for (int i = 0; i < c.req.keys_size(); ++i) {
      CHECK_OR_DIE(c.rep.values(i) == m.kv.at(c.req.keys(i)));
    }
  }

  // Waits that left the core: each was parked, and leaves once.
  void answered(const std::vector<StoreWaitPtr>& out, bool by_write) {
    for (const StoreWaitPtr& w : out) {
      auto c = std::static_pointer_cast<Call>(w);
      CHECK_OR_DIE(parked_.erase(c) == 1);
      CHECK_OR_DIE(!core_.cancel(*c, absl::CancelledError("late")));
      if (by_write) {
        const int run = c->req.run_id().back() - '0';
        if (c->status.ok()) {
          check_read(models_[run], *c);
        } else {
          // Only a MULTI_GET whose values would not fit one reply.
          CHECK_OR_DIE(c->status.code() == absl::StatusCode::kResourceExhausted);
          CHECK_OR_DIE(c->req.op() == StoreRequest::MULTI_GET);
        }
      }
    }
    check_parked_count();
  }

  void check_table(int run) {
    const Model& m = models_[run];
    auto s = core_.stats(kRuns[run]);
    CHECK_OR_DIE(s.has_value() == m.open);
    if (!s) return;
    const auto& l = core_.limits();
    CHECK_OR_DIE(s->keys == m.kv.size());
    CHECK_OR_DIE(s->bytes == m.bytes());
    CHECK_OR_DIE(s->keys <= l.max_keys);
    CHECK_OR_DIE(s->bytes <= l.max_bytes);
  }

  void check_parked_count() { CHECK_OR_DIE(core_.parked_waits() == parked_.size()); }

  StoreCore core_;
  StoreClock::time_point now_;
  Model models_[kRunCount];
  std::map<std::shared_ptr<Call>, StoreClock::time_point> parked_;  // -> its deadline
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader in{data, size};
  Harness h;
  for (int steps = 0; !in.empty() && steps < 512; ++steps) h.step(in);
  h.finish();
  return 0;
}
