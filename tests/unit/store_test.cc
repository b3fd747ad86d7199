// One conformance suite for every Store implementation (c10d's testHelper idea).
#include <chrono>
#include <future>
#include <limits>
#include <mutex>
#include <set>
#include <thread>

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>

#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/memory_store.h"
#include "muster/rendezvous/prefix_store.h"
#include "muster/v1/rendezvous.grpc.pb.h"
#include "proc.h"
// The store service itself (private to the rendezvous library; tests drive it directly).
#include "../../rendezvous/src/store/store_server.h"

using namespace std::chrono_literals;
using muster::rendezvous::Store;
using muster::rendezvous::StoreLimits;

namespace {

// Waits (bounded) until `pred` holds; the store has no event to wait on for these counters.
template <class P>
bool eventually(P pred) {
  for (auto end = std::chrono::steady_clock::now() + 5s; std::chrono::steady_clock::now() < end;) {
    if (pred()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return pred();
}

StoreLimits small_limits() {
  StoreLimits l;
  l.max_key_bytes = 64;
  l.max_value_bytes = 1024;
  l.max_keys = 16;
  l.max_bytes = 3000;
  l.max_keys_per_request = 32;
  l.max_message_bytes = 2500;
  return l;
}

struct MemoryFixture {
  static constexpr bool kWritesBehind = false;
  muster::rendezvous::MemoryStore store{small_limits()};
  Store& get() { return store; }
  std::size_t parked() const { return store.waiting(); }
};

struct PrefixFixture {
  static constexpr bool kWritesBehind = false;
  muster::rendezvous::MemoryStore base{small_limits()};
  muster::rendezvous::PrefixStore store{"/run/1/", base};
  Store& get() { return store; }
  std::size_t parked() const { return base.waiting(); }
};

// A real Store service on 127.0.0.1:0 (the StoreServer the rendezvous server embeds, on a
// bare grpc::Server, so that the test opens its runs itself as the rendezvous does on a
// Join), and a client.
struct GrpcFixture {
  static constexpr bool kWritesBehind = true;  // see grpc_store.h
  muster::rendezvous::StoreServer service{small_limits(),
                                          std::make_shared<muster::rendezvous::Credentials>("secret")};
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
  std::size_t parked() const { return service.parked_waits(); }
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
  CHECK(eventually([&] { return f.parked() == 2; }));  // both wait before any write
  REQUIRE(s.set("k", "v").ok());
  getter.join();
  // "k" completed the get, not the wait for both: that one is still parked.
  CHECK(f.parked() == 1);
  REQUIRE(s.set("k2", "v2").ok());
  waiter.join();
  CHECK(f.parked() == 0);
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

TEMPLATE_TEST_CASE("store: a multi_set at the key limit writes nothing or everything",
                   "[store][limits]", MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  for (int i = 0; i < 14; ++i) REQUIRE(s.multi_set({"key" + std::to_string(i)}, {"v"}).ok());
  auto st = s.multi_set({"a", "b", "c"}, {"1", "2", "3"});
  CHECK(st.code() == absl::StatusCode::kResourceExhausted);
  CHECK(*s.num_keys() == 14);
  CHECK_FALSE(*s.check({"a"}));
  CHECK_FALSE(*s.check({"b"}));
  // Two distinct new keys (one named twice) and a replaced one fit exactly; the last value of
  // a key named twice wins.
  REQUIRE(s.multi_set({"a", "b", "a", "key0"}, {"1", "2", "3", "4"}).ok());
  CHECK(*s.num_keys() == 16);
  CHECK(*s.get("a", 1s) == "3");
  CHECK(*s.get("key0", 1s) == "4");
}

TEMPLATE_TEST_CASE("store: a run's table is bounded by bytes as well as keys", "[store][limits]",
                   MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  const std::string kb(1000, 'v');
  REQUIRE(s.multi_set({"b0", "b1"}, {kb, kb}).ok());
  auto st = s.multi_set({"b2"}, {kb});  // over 3000 bytes of keys and values
  CHECK(st.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(st.message()), Catch::Contains("bytes"));
  CHECK_FALSE(*s.check({"b2"}));
  REQUIRE(s.multi_set({"b0"}, {kb}).ok());   // replacing costs no more
  REQUIRE(s.multi_set({"b1"}, {"x"}).ok());  // and a smaller value frees room
  REQUIRE(s.multi_set({"b2"}, {kb}).ok());
  CHECK(s.multi_set({"b3"}, {kb}).code() == absl::StatusCode::kResourceExhausted);
  CHECK(*s.num_keys() == 3);
}

TEMPLATE_TEST_CASE("store: requests with too many keys or too large a reply are refused",
                   "[store][limits]", MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  std::vector<std::string> many;
  for (int i = 0; i < 33; ++i) many.push_back("k" + std::to_string(i));
  CHECK(s.check(many).status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(s.wait(many, 10ms).code() == absl::StatusCode::kResourceExhausted);
  const std::string big(900, 'v');
  REQUIRE(s.multi_set({"x", "y", "z"}, {big, big, big}).ok());
  auto got = s.multi_get({"x", "y", "z"}, 1s);  // 2700 bytes of values: over 2500
  CHECK(got.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(s.multi_get({"x", "y"}, 1s).ok());
}

TEMPLATE_TEST_CASE("store: a huge timeout waits and a negative one does not", "[store][timeout]",
                   MemoryFixture, PrefixFixture, GrpcFixture) {
  TestType f;
  Store& s = f.get();
  const Store::Duration huge(std::numeric_limits<std::int64_t>::max() / 2);
  absl::StatusOr<std::string> got;
  absl::Status waited;
  std::thread getter([&] { got = s.get("late", huge); });
  std::thread waiter([&] { waited = s.wait({"late"}, huge); });
  CHECK(eventually([&] { return f.parked() == 2; }));  // both parked, neither timed out
  REQUIRE(s.set("late", "v").ok());
  getter.join();
  waiter.join();
  REQUIRE(got.ok());
  CHECK(*got == "v");
  CHECK(waited.ok());
  auto t0 = std::chrono::steady_clock::now();
  CHECK(s.get("missing", -5ms).status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - t0 < muster::testing::scaled(5s));
  CHECK(*s.get("late", -5ms) == "v");
}

TEMPLATE_TEST_CASE("store: add does not wrap", "[store][add]", MemoryFixture, PrefixFixture,
                   GrpcFixture) {
  TestType f;
  Store& s = f.get();
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  CHECK(*s.add("n", kMax) == kMax);
  auto over = s.add("n", 1);
  CHECK(over.status().code() == absl::StatusCode::kOutOfRange);
  CHECK_THAT(std::string(over.status().message()), Catch::Contains("n' "));  // PrefixStore names its full key
  CHECK(*s.get("n", 1s) == std::to_string(kMax));
  CHECK(*s.add("m", kMin) == kMin);
  CHECK(s.add("m", -1).status().code() == absl::StatusCode::kOutOfRange);
  CHECK(*s.add("m", kMax) == -1);
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
using muster::v1::StoreReply;
using muster::v1::StoreRequest;

// One raw stream to the fixture's server, for requests GrpcStore would not send.
struct RawStream {
  grpc::ClientContext ctx;
  std::unique_ptr<muster::v1::Store::Stub> stub;
  std::unique_ptr<grpc::ClientReaderWriter<StoreRequest, StoreReply>> rw;
  explicit RawStream(int port)
      : stub(muster::v1::Store::NewStub(grpc::CreateChannel(
            "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()))),
        rw(stub->Stream(&ctx)) {}
  // Sends and reads the answer on another thread.
  std::future<StoreReply> send(const StoreRequest& req) {
    REQUIRE(rw->Write(req));
    return std::async(std::launch::async, [this] {
      StoreReply rep;
      if (!rw->Read(&rep)) rep.set_code(-1);  // the stream ended
      return rep;
    });
  }
};

StoreRequest request(StoreRequest::Op op, const std::string& run, std::vector<std::string> keys,
                     std::int64_t timeout_ms = 0) {
  StoreRequest r;
  r.set_op(op);
  r.set_run_id(run);
  r.set_token("secret");
  for (auto& k : keys) r.add_keys(k);
  r.set_timeout_ms(timeout_ms);
  return r;
}

}  // namespace

TEST_CASE("store: a request for a run the rendezvous never opened is refused", "[store][runs]") {
  GrpcFixture f;
  auto stranger = f.client("nobody", "secret");
  auto st = stranger->check({"k"}).status();
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(st.message()), Catch::Contains("store: unknown run 'nobody'"));
  f.service.drop("other");
  auto other = f.client("other", "secret");
  CHECK(other->check({"k"}).status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("store: a run id that is not UTF-8 is refused, keys may be any bytes",
          "[store][runs]") {
  GrpcFixture f;
  RawStream raw(f.port);
  auto bad = raw.send(request(StoreRequest::CHECK, "run\xff\xfe", {"k"})).get();
  CHECK(bad.code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(bad.error(), Catch::Contains("UTF-8"));
  REQUIRE(f.store->set(std::string("\xff\x00k", 3), "v").ok());
  CHECK(*f.store->get(std::string("\xff\x00k", 3), 1s) == "v");
}

TEST_CASE("store: a GET of INT64_MAX ms parks instead of timing out", "[store][timeout]") {
  GrpcFixture f;
  RawStream raw(f.port);
  auto reply = raw.send(request(StoreRequest::GET, "run", {"k"},
                                std::numeric_limits<std::int64_t>::max()));
  REQUIRE(eventually([&] { return f.service.parked_waits() == 1; }));
  CHECK(reply.wait_for(50ms) == std::future_status::timeout);
  REQUIRE(f.store->set("k", "v").ok());
  REQUIRE(reply.wait_for(5s) == std::future_status::ready);
  auto rep = reply.get();
  CHECK(rep.code() == 0);
  CHECK(rep.values(0) == "v");
}

TEST_CASE("store: shutdown answers parked waits at once and refuses later requests",
          "[store][shutdown]") {
  GrpcFixture f;
  RawStream raw(f.port);
  auto reply = raw.send(request(StoreRequest::GET, "run", {"never"}, 300000));
  REQUIRE(eventually([&] { return f.service.parked_waits() == 1; }));
  auto stopped = std::async(std::launch::async, [&] {
    f.service.shutdown();
    f.server->Shutdown(std::chrono::system_clock::now() + 30s);  // the grace is not needed
    f.server->Wait();
  });
  REQUIRE(reply.wait_for(1s) == std::future_status::ready);
  auto rep = reply.get();
  CHECK(rep.code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(rep.error() == "store: the server is shutting down");
  CHECK(stopped.wait_for(1s) == std::future_status::ready);
  CHECK(f.service.parked_waits() == 0);
}

TEST_CASE("store: server shutdown cancels parked waits (OnCancel)", "[store][shutdown]") {
  GrpcFixture f;
  RawStream raw(f.port);
  auto reply = raw.send(request(StoreRequest::GET, "run", {"never"}, 300000));
  REQUIRE(eventually([&] { return f.service.parked_waits() == 1; }));
  auto stopped = std::async(std::launch::async, [&] {
    f.server->Shutdown(std::chrono::system_clock::now());
    f.server->Wait();
  });
  REQUIRE(stopped.wait_for(1s) == std::future_status::ready);
  CHECK(f.service.parked_waits() == 0);
  CHECK(reply.wait_for(1s) == std::future_status::ready);
}

TEST_CASE("store: a client that cancels its parked wait frees it", "[store][shutdown]") {
  GrpcFixture f;
  {
    RawStream raw(f.port);
    auto reply = raw.send(request(StoreRequest::WAIT, "run", {"never", "either"}, 300000));
    REQUIRE(eventually([&] { return f.service.parked_waits() == 1; }));
    raw.ctx.TryCancel();
    REQUIRE(reply.wait_for(5s) == std::future_status::ready);
  }
  CHECK(eventually([&] { return f.service.parked_waits() == 0; }));
  // The store still serves, and the freed waiter is not answered by a later write.
  REQUIRE(f.store->set("never", "v").ok());
  REQUIRE(f.store->set("either", "v").ok());
  CHECK(*f.store->get("never", 1s) == "v");
}

TEST_CASE("store: drop answers the run's parked waits and frees its table", "[store][runs]") {
  GrpcFixture f;
  RawStream raw(f.port);
  REQUIRE(f.store->set("k", std::string(1000, 'v')).ok());
  auto reply = raw.send(request(StoreRequest::GET, "run", {"never"}, 300000));
  REQUIRE(eventually([&] { return f.service.parked_waits() == 1; }));
  f.service.drop("run");
  REQUIRE(reply.wait_for(1s) == std::future_status::ready);
  auto rep = reply.get();
  CHECK(rep.code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(f.service.parked_waits() == 0);
  f.service.open_run("run");  // a run opened again starts empty
  CHECK_FALSE(*f.store->check({"k"}));
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
