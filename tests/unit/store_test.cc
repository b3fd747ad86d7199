// One conformance suite for every Store implementation (c10d's testHelper idea).
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>

#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/memory_store.h"
#include "muster/rendezvous/prefix_store.h"
#include "muster/v1/rendezvous.grpc.pb.h"
// The store service itself (private to the rendezvous library; tests drive it directly).
#include "../../rendezvous/src/store_server.h"

using namespace std::chrono_literals;
using muster::rendezvous::Store;
using muster::rendezvous::StoreLimits;

namespace {

StoreLimits small_limits() {
  StoreLimits l;
  l.max_key_bytes = 64;
  l.max_value_bytes = 1024;
  l.max_keys = 16;
  return l;
}

struct MemoryFixture {
  static constexpr bool kWritesBehind = false;
  muster::rendezvous::MemoryStore store{small_limits()};
  Store& get() { return store; }
};

struct PrefixFixture {
  static constexpr bool kWritesBehind = false;
  muster::rendezvous::MemoryStore base{small_limits()};
  muster::rendezvous::PrefixStore store{"/run/1/", base};
  Store& get() { return store; }
};

// A real Store service on 127.0.0.1:0 (the StoreServer the rendezvous server embeds, on a
// bare grpc::Server, so that the test opens its runs itself as the rendezvous does on a
// Join), and a client.
struct GrpcFixture {
  static constexpr bool kWritesBehind = true;  // see grpc_store.h
  muster::rendezvous::StoreServer service{small_limits(), "secret"};
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<muster::rendezvous::GrpcStore> store;
  GrpcFixture() {
    service.open_run("run");
    service.open_run("other");
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    service.register_with(b);
    server = b.BuildAndStart();
    REQUIRE(server);
    store = client("run", "secret");
  }
  std::unique_ptr<muster::rendezvous::GrpcStore> client(const std::string& run,
                                                        const std::string& token) {
    return std::make_unique<muster::rendezvous::GrpcStore>(muster::rendezvous::GrpcStoreOptions{
        "127.0.0.1:" + std::to_string(port), run, token});
  }
  ~GrpcFixture() {
    store.reset();
    service.shutdown();
    server->Shutdown(std::chrono::system_clock::now());
    server->Wait();
  }
  Store& get() { return *store; }
};

}  // namespace

TEMPLATE_TEST_CASE("store: set and get", "[store]", MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  REQUIRE(s.set("a", "1").ok());
  REQUIRE(s.set("a", std::string("x\0y", 3)).ok());
  auto v = s.get("a", 1s);
  REQUIRE(v.ok());
  CHECK(*v == std::string("x\0y", 3));
  REQUIRE(s.set("empty", "").ok());
  CHECK(*s.get("empty", 1s) == "");
}

TEMPLATE_TEST_CASE("store: a get that times out says so", "[store]", MemoryFixture, PrefixFixture,
                   GrpcFixture) {
  TestType f;
  auto v = f.get().get("missing", 50ms);
  CHECK(v.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(f.get().wait({"missing"}, 50ms).code() == absl::StatusCode::kDeadlineExceeded);
}

TEMPLATE_TEST_CASE("store: waiters are woken by the write that completes them", "[store]",
                   MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  absl::StatusOr<std::string> got;
  absl::Status waited;
  std::thread getter([&] { got = s.get("k", 30s); });
  std::thread waiter([&] { waited = s.wait({"k", "k2"}, 30s); });
  REQUIRE(s.set("k", "v").ok());
  REQUIRE(s.set("k2", "v2").ok());
  getter.join();
  waiter.join();
  REQUIRE(got.ok());
  CHECK(*got == "v");
  CHECK(waited.ok());
}

TEMPLATE_TEST_CASE("store: add", "[store]", MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  CHECK(*s.add("n", 5) == 5);
  CHECK(*s.add("n", -2) == 3);
  CHECK(*s.get("n", 1s) == "3");
  REQUIRE(s.set("text", "abc").ok());
  CHECK(s.add("text", 1).status().code() == absl::StatusCode::kInvalidArgument);
}

TEMPLATE_TEST_CASE("store: add from many threads counts every call", "[store]", MemoryFixture,
                   GrpcFixture) {
  TestType f;
  Store& s = f.get();
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&s] {
      for (int i = 0; i < 50; ++i) REQUIRE(s.add("count", 1).ok());
    });
  }
  for (auto& t : ts) t.join();
  CHECK(*s.get("count", 1s) == "200");
}

TEMPLATE_TEST_CASE("store: compare_set follows c10d", "[store]", MemoryFixture, PrefixFixture,
                   GrpcFixture) {
  TestType f;
  Store& s = f.get();
  // Missing key, non-empty expected: nothing changes, expected comes back.
  CHECK(*s.compare_set("k", "old", "new") == "old");
  CHECK_FALSE(*s.check({"k"}));
  // Missing key, empty expected: created.
  CHECK(*s.compare_set("k", "", "first") == "first");
  // Match: swapped.
  CHECK(*s.compare_set("k", "first", "second") == "second");
  // Mismatch: the current value comes back, unchanged.
  CHECK(*s.compare_set("k", "first", "third") == "second");
  CHECK(*s.get("k", 1s) == "second");
}

TEMPLATE_TEST_CASE("store: delete, check, num_keys", "[store]", MemoryFixture, PrefixFixture,
                   GrpcFixture) {
  TestType f;
  Store& s = f.get();
  REQUIRE(s.set("a", "1").ok());
  REQUIRE(s.set("b", "2").ok());
  CHECK(*s.check({"a", "b"}));
  CHECK_FALSE(*s.check({"a", "c"}));
  CHECK(*s.num_keys() == 2);
  CHECK(*s.delete_key("a"));
  CHECK_FALSE(*s.delete_key("a"));
  CHECK(*s.num_keys() == 1);
}

TEMPLATE_TEST_CASE("store: multi_set and multi_get", "[store]", MemoryFixture, PrefixFixture,
                   GrpcFixture) {
  TestType f;
  Store& s = f.get();
  REQUIRE(s.multi_set({"x", "y", "z"}, {"1", "2", "3"}).ok());
  auto v = s.multi_get({"z", "x"}, 1s);
  REQUIRE(v.ok());
  CHECK(*v == std::vector<std::string>{"3", "1"});
  CHECK(s.multi_set({"p"}, {"1", "2"}).code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.multi_get({"x", "nope"}, 50ms).status().code() == absl::StatusCode::kDeadlineExceeded);
}

TEMPLATE_TEST_CASE("store: limits are enforced and leave the table as it was", "[store]",
                   MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  REQUIRE(s.check({"warm"}).ok());  // GrpcStore's first call on a stream is never written behind
  // The refusal of a set: from set itself, or, where sets are written behind, from the next
  // call (which is then not carried out).
  auto refusal = [&](absl::Status from_set) {
    if (!TestType::kWritesBehind) return from_set;
    CHECK(from_set.ok());
    return s.check({"k"}).status();
  };
  auto key_error = refusal(s.set(std::string(100, 'k'), "v"));
  CHECK(key_error.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(key_error.message()), Catch::Contains("key"));
  auto value_error = refusal(s.set("k", std::string(2000, 'v')));
  CHECK(value_error.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(value_error.message()), Catch::Contains("value"));
  CHECK_FALSE(*s.check({"k"}));
  for (int i = 0; i < 16; ++i) REQUIRE(s.set("key" + std::to_string(i), "v").ok());
  CHECK(refusal(s.set("one-more", "v")).code() == absl::StatusCode::kResourceExhausted);
  CHECK(s.set("key3", "replaced").ok());  // replacing is not a new key
  CHECK(*s.num_keys() == 16);
  CHECK(*s.get("key3", 1s) == "replaced");
}

TEST_CASE("store: a refused set written behind fails the next call, which is not carried out",
          "[store]") {
  GrpcFixture f;
  Store& s = f.get();
  REQUIRE(s.set("first", "v").ok());  // answered: the stream is open
  REQUIRE(s.set("big", std::string(2000, 'v')).ok());  // written behind
  auto next = s.add("n", 1);
  REQUIRE(next.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(next.status().message()), Catch::Contains("earlier set of \"big\""));
  CHECK_FALSE(*s.check({"n"}));
  CHECK_FALSE(*s.check({"big"}));
  // A read sent behind a refused set returns the refusal too.
  REQUIRE(s.set("big", std::string(2000, 'v')).ok());
  CHECK(s.get("first", 1s).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(*s.get("first", 1s) == "v");
}

TEST_CASE("store: a call with a wrong secret is refused", "[store]") {
  GrpcFixture f;
  auto bad = f.client("run", "guess");
  auto st = bad->set("k", "v");
  CHECK(st.code() == absl::StatusCode::kPermissionDenied);
  CHECK_FALSE(*f.store->check({"k"}));
}

TEST_CASE("store: runs have separate tables", "[store]") {
  GrpcFixture f;
  auto other = f.client("other", "secret");
  REQUIRE(f.store->set("k", "mine").ok());
  REQUIRE(other->set("k", "theirs").ok());
  CHECK(*f.store->get("k", 1s) == "mine");
  CHECK(*other->get("k", 1s) == "theirs");
}

namespace {
// Serves a fake Store service on 127.0.0.1:0.
std::unique_ptr<grpc::Server> serve_fake(grpc::Service& service, int& port) {
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  return b.BuildAndStart();
}

// A fake Store server. kSilent: alive, reads every request and never answers. kSlowSets:
// applies a SET 200 ms after reading it (then answers) and answers a CHECK at once, so a
// request on another stream can overtake a set still being applied.
class FakeStore final : public muster::v1::Store::CallbackService {
 public:
  enum class Mode { kSilent, kSlowSets };
  explicit FakeStore(Mode mode) : mode_(mode) {}
  ~FakeStore() {
    for (auto& t : threads_) t.join();
  }

 private:
  class Reactor final
      : public grpc::ServerBidiReactor<muster::v1::StoreRequest, muster::v1::StoreReply> {
   public:
    explicit Reactor(FakeStore* s) : s_(s) { StartRead(&req_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
      } else if (s_->mode_ == Mode::kSilent) {
        StartRead(&req_);
      } else if (req_.op() == muster::v1::StoreRequest::SET) {
        std::lock_guard lock(s_->mu_);
        s_->threads_.emplace_back([this, key = req_.keys(0)] {
          std::this_thread::sleep_for(200ms);  // the delay is the point of this fake
          {
            std::lock_guard lock(s_->mu_);
            s_->keys_.insert(key);
          }
          rep_.Clear();
          StartWrite(&rep_);
        });
      } else {
        std::lock_guard lock(s_->mu_);
        rep_.Clear();
        rep_.set_flag(s_->keys_.count(req_.keys(0)) > 0);
        StartWrite(&rep_);
      }
    }
    void OnWriteDone(bool ok) override {
      if (ok) {
        StartRead(&req_);
      } else {
        Finish(grpc::Status::OK);
      }
    }
    void OnDone() override { delete this; }

   private:
    FakeStore* s_;
    muster::v1::StoreRequest req_;
    muster::v1::StoreReply rep_;
  };
  grpc::ServerBidiReactor<muster::v1::StoreRequest, muster::v1::StoreReply>* Stream(
      grpc::CallbackServerContext*) override {
    return new Reactor(this);
  }

  const Mode mode_;
  std::mutex mu_;
  std::set<std::string> keys_;
  std::vector<std::thread> threads_;
};

}  // namespace

TEST_CASE("store: a server that stops answering fails the call after the timeout, not never",
          "[store]") {
  FakeStore service(FakeStore::Mode::kSilent);
  int port = 0;
  auto server = serve_fake(service, port);
  REQUIRE(server);
  muster::rendezvous::GrpcStoreOptions o{"127.0.0.1:" + std::to_string(port), "run", ""};
  o.timeout = 200ms;
  {
    muster::rendezvous::GrpcStore store(o);
    auto st = store.set("k", "v");  // the first call on a stream is answered: here, never
    CHECK(st.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK_THAT(std::string(st.message()), Catch::Contains("no answer"));
    auto got = store.get("k", 300ms);  // its own wait, then the timeout
    CHECK(got.status().code() == absl::StatusCode::kDeadlineExceeded);
  }  // and the destructor does not hang either (a hang here is ctest's timeout)
  server->Shutdown(std::chrono::system_clock::now());
}

TEST_CASE("store: a call after a set written behind is not overtaken on another stream",
          "[store]") {
  FakeStore service(FakeStore::Mode::kSlowSets);
  int port = 0;
  auto server = serve_fake(service, port);
  REQUIRE(server);
  {
    muster::rendezvous::GrpcStore store({"127.0.0.1:" + std::to_string(port), "run", ""});
    // Two overlapping first calls open two streams; both end up free.
    std::thread other([&] { CHECK(store.set("a", "v").ok()); });
    CHECK(store.set("b", "v").ok());
    other.join();
    // Written behind on one stream, which then sits last among the free ones. The check must
    // follow it on that stream (and so see it), not take the other, idle one.
    REQUIRE(store.set("k", "v").ok());
    auto seen = store.check({"k"});
    REQUIRE(seen.ok());
    CHECK(*seen);
  }
  server->Shutdown(std::chrono::system_clock::now());
}
