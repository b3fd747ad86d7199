// StoreCore (the Store service's request handling, without gRPC): the waiter index and the
// deadlines, driven with an injected clock.
#include <chrono>
#include <limits>

#include <catch2/catch.hpp>

// Private to the rendezvous library; the tests drive it directly.
#include "../../rendezvous/src/store/store_core.h"

using namespace std::chrono_literals;
using muster::rendezvous::StoreClock;
using muster::rendezvous::StoreCore;
using muster::rendezvous::StoreWait;
using muster::rendezvous::StoreWaitPtr;
using muster::v1::StoreReply;
using muster::v1::StoreRequest;

namespace {

// A request with its reply, as a reactor holds them.
struct Call : StoreWait {
  StoreRequest req;
  StoreReply rep;
  Call() : StoreWait(&req, &rep) {}
};

std::shared_ptr<Call> call(StoreRequest::Op op, const std::string& run,
                           std::vector<std::string> keys, std::vector<std::string> values = {},
                           std::int64_t timeout_ms = 0) {
  auto c = std::make_shared<Call>();
  c->req.set_op(op);
  c->req.set_run_id(run);
  for (auto& k : keys) c->req.add_keys(k);
  for (auto& v : values) c->req.add_values(v);
  c->req.set_timeout_ms(timeout_ms);
  return c;
}

struct Core {
  StoreCore core{StoreCore::Options{}};
  StoreClock::time_point now = StoreClock::now();
  std::vector<StoreWaitPtr> woken;
  Core() {
    core.open_run("a");
    core.open_run("b");
  }
  std::optional<absl::Status> run(const std::shared_ptr<Call>& c) {
    woken.clear();
    return core.handle(c, now, woken);
  }
};

}  // namespace

TEST_CASE("store core: a write to one run does not touch another run's waits",
          "[store][core]") {
  Core f;
  std::vector<std::string> many;
  for (int i = 0; i < 50000; ++i) many.push_back("k" + std::to_string(i));
  auto big = call(StoreRequest::WAIT, "a", many, {}, 60000);
  REQUIRE_FALSE(f.run(big).has_value());  // parked
  CHECK(f.core.stats("a")->parked == 1);
  for (int i = 0; i < 100; ++i) {
    REQUIRE(f.run(call(StoreRequest::SET, "b", {"x" + std::to_string(i)}, {"v"}))->ok());
    REQUIRE(f.run(call(StoreRequest::GET, "b", {"x" + std::to_string(i)}, {}, 1000))->ok());
  }
  CHECK(f.core.stats("a")->wait_visits == 0);
  // In its own run, a write of a key nobody waits for looks at no wait either; one of a
  // missed key looks at its waits once.
  REQUIRE(f.run(call(StoreRequest::SET, "a", {"other"}, {"v"}))->ok());
  CHECK(f.core.stats("a")->wait_visits == 0);
  REQUIRE(f.run(call(StoreRequest::SET, "a", {"k7"}, {"v"}))->ok());
  CHECK(f.core.stats("a")->wait_visits == 1);
  CHECK(f.core.stats("a")->indexed_keys == many.size() - 1);
  CHECK(f.core.cancel(*big, absl::CancelledError("gone")));
  CHECK_FALSE(f.core.cancel(*big, absl::CancelledError("twice")));
  CHECK(f.core.parked_waits() == 0);
  CHECK(f.core.stats("a")->indexed_keys == 0);  // the index is freed with the wait
}

TEST_CASE("store core: a wait completes when all its keys exist, after deletes too",
          "[store][core]") {
  Core f;
  auto w = call(StoreRequest::MULTI_GET, "a", {"p", "q", "p"}, {}, 60000);
  REQUIRE_FALSE(f.run(w).has_value());
  REQUIRE(f.run(call(StoreRequest::SET, "a", {"p"}, {"1"}))->ok());
  REQUIRE(f.run(call(StoreRequest::DELETE, "a", {"p"}))->ok());
  REQUIRE(f.run(call(StoreRequest::SET, "a", {"q"}, {"2"}))->ok());
  CHECK(f.woken.empty());  // p is gone again
  REQUIRE(f.run(call(StoreRequest::MULTI_SET, "a", {"p"}, {"3"}))->ok());
  REQUIRE(f.woken.size() == 1);
  CHECK(f.woken[0] == w);
  CHECK(w->status.ok());
  CHECK(w->rep.values_size() == 3);
  CHECK(w->rep.values(0) == "3");
  CHECK(w->rep.values(1) == "2");
  CHECK(f.core.parked_waits() == 0);
}

TEST_CASE("store core: huge and negative timeouts saturate", "[store][core][timeout]") {
  Core f;
  auto huge = call(StoreRequest::GET, "a", {"k"}, {}, std::numeric_limits<std::int64_t>::max());
  auto neg = call(StoreRequest::GET, "a", {"k"}, {}, -5);
  REQUIRE_FALSE(f.run(huge).has_value());
  REQUIRE_FALSE(f.run(neg).has_value());
  auto out = f.core.expire(f.now);
  REQUIRE(out.size() == 1);  // the negative one: at once
  CHECK(out[0] == neg);
  CHECK(neg->status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(f.core.expire(f.now + std::chrono::hours(23)).empty());
  out = f.core.expire(f.now + std::chrono::hours(24));  // limits::kMaxStoreWait
  REQUIRE(out.size() == 1);
  CHECK(out[0] == huge);
}

TEST_CASE("store core: drop and shutdown answer parked waits", "[store][core]") {
  Core f;
  auto in_a = call(StoreRequest::WAIT, "a", {"k"}, {}, 60000);
  auto in_b = call(StoreRequest::WAIT, "b", {"k"}, {}, 60000);
  REQUIRE_FALSE(f.run(in_a).has_value());
  REQUIRE_FALSE(f.run(in_b).has_value());
  auto out = f.core.drop("a");
  REQUIRE(out.size() == 1);
  CHECK(in_a->status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(f.run(call(StoreRequest::CHECK, "a", {"k"}))->code() ==
        absl::StatusCode::kFailedPrecondition);
  out = f.core.shutdown();
  REQUIRE(out.size() == 1);
  CHECK(in_b->status.code() == absl::StatusCode::kUnavailable);
  CHECK(f.run(call(StoreRequest::CHECK, "b", {"k"}))->code() == absl::StatusCode::kUnavailable);
  CHECK(f.core.parked_waits() == 0);
  CHECK_FALSE(f.core.next_deadline().has_value());
}
