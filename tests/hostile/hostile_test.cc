// Hostile clients against a real rdzvd (issue 10): each attack is made with raw gRPC calls,
// while and after which a real two-agent job (launch x2, workers using the store and the TCP
// ring) must still succeed, and rdzvd's resident memory must stay bounded during the attack
// and come back to within twice its idle size once the attackers have gone.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "muster/rendezvous/limits.h"
#include "muster/v1/rendezvous.grpc.pb.h"
#include "held_run.h"
#include "proc.h"

using namespace muster::testing;
namespace v1 = muster::v1;
namespace limits = muster::rendezvous::limits;

namespace {

const std::string kLaunch = LAUNCH_BIN;
const std::string kRdzvd = RDZVD_BIN;
const std::string kCollective = COLLECTIVE_WORKER_BIN;

// Memory rdzvd may hold while an attack is under way, above its idle size.
constexpr long kAttackSlackKb = 400 * 1024;

long rss_kb(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

struct Daemon {
  std::unique_ptr<Proc> proc;
  std::string endpoint;
  long idle_kb = 0;
  Daemon() {
    proc = std::make_unique<Proc>(std::vector<std::string>{kRdzvd, "--listen", "127.0.0.1:0"});
    REQUIRE(proc->wait_output(
        [](const std::string& out, const std::string&) { return out.find('\n') != std::string::npos; },
        30s));
    std::smatch m;
    REQUIRE(std::regex_search(proc->out(), m, std::regex(R"(listening on port (\d+))")));
    endpoint = "127.0.0.1:" + m[1].str();
  }
  ~Daemon() {
    ::kill(proc->pid(), SIGTERM);
    CHECK(proc->wait(10s) == 0);  // SIGTERM ends it at once, whatever the attackers left
  }
  long rss() const { return rss_kb(proc->pid()); }
};

// A connection of its own (never shared through gRPC's subchannel pool). A slow reader keeps
// HTTP/2's initial window (no BDP probing) so what it does not read stays on the server.
std::shared_ptr<grpc::Channel> connect(const std::string& endpoint, bool slow_reader = false) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (slow_reader) args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  return grpc::CreateCustomChannel(endpoint, grpc::InsecureChannelCredentials(), args);
}

class StoreStream {
 public:
  explicit StoreStream(const std::shared_ptr<grpc::Channel>& ch) : stub_(v1::Store::NewStub(ch)) {
    ctx_.set_deadline(std::chrono::system_clock::now() + 120s);
    stream_ = stub_->Stream(&ctx_);
  }
  ~StoreStream() {
    ctx_.TryCancel();
    stream_->Finish();
  }
  bool send(const v1::StoreRequest& r) { return stream_->Write(r); }
  v1::StoreReply recv() {
    v1::StoreReply reply;
    if (!stream_->Read(&reply)) reply.set_code(-1);  // the stream ended
    return reply;
  }
  v1::StoreReply call(const v1::StoreRequest& r) {
    send(r);
    return recv();
  }

 private:
  std::unique_ptr<v1::Store::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StoreRequest, v1::StoreReply>> stream_;
};

v1::StoreRequest store_req(const std::string& run, v1::StoreRequest::Op op,
                           std::vector<std::string> keys, std::vector<std::string> values = {}) {
  v1::StoreRequest r;
  r.set_run_id(run);
  r.set_op(op);
  for (auto& k : keys) r.add_keys(std::move(k));
  for (auto& v : values) r.add_values(std::move(v));
  return r;
}

class Session {
 public:
  explicit Session(const std::shared_ptr<grpc::Channel>& ch) : stub_(v1::Rendezvous::NewStub(ch)) {
    ctx_.set_deadline(std::chrono::system_clock::now() + 120s);
    stream_ = stub_->Session(&ctx_);
  }
  ~Session() {
    ctx_.TryCancel();
    if (!finished_) stream_->Finish();
  }
  bool send(const v1::AgentMsg& m) { return stream_->Write(m); }
  bool read(v1::ServerMsg* m) { return stream_->Read(m); }
  // Reads to the end of the stream; its final status.
  grpc::Status end() {
    v1::ServerMsg m;
    while (stream_->Read(&m)) {
    }
    finished_ = true;
    return stream_->Finish();
  }

 private:
  bool finished_ = false;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMsg, v1::ServerMsg>> stream_;
};

v1::AgentMsg join_msg(const std::string& run, int min_nodes, int max_nodes,
                      const std::string& node = "hostile") {
  v1::AgentMsg m;
  v1::Join* j = m.mutable_join();
  j->set_run_id(run);
  j->set_node_id(node);
  j->set_host("127.0.0.1");
  j->set_local_world_size(1);
  j->set_min_nodes(min_nodes);
  j->set_max_nodes(max_nodes);
  j->set_requested_rank(-1);
  return m;
}

v1::StatusReply status(const std::string& endpoint) {
  auto stub = v1::Rendezvous::NewStub(connect(endpoint));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  v1::StatusRequest req;
  v1::StatusReply reply;
  grpc::Status st = stub->GetStatus(&ctx, req, &reply);
  REQUIRE(st.ok());
  return reply;
}

// Bounded wait for a condition the server exposes only through GetStatus (no event exists).
bool eventually(const std::string& endpoint, const std::function<bool(const v1::StatusReply&)>& pred,
                std::chrono::milliseconds timeout = 20s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto pause = 1ms; std::chrono::steady_clock::now() < deadline; pause = std::min(pause * 2, 100ms)) {
    if (pred(status(endpoint))) return true;
    std::this_thread::sleep_for(pause);
  }
  return false;
}

bool has_run(const v1::StatusReply& r, const std::string& prefix) {
  for (const auto& run : r.runs()) {
    if (run.run_id().rfind(prefix, 0) == 0) return true;
  }
  return false;
}

// The real job: two agents of two workers each; the workers meet through the store, build
// the TCP ring and check an all_reduce.
void real_job_succeeds(const std::string& endpoint, const std::string& id) {
  auto args = [&] {
    return std::vector<std::string>{kLaunch, "--nnodes=2", "--nproc_per_node=2",
                                    "--rdzv_backend=c10d", "--rdzv_endpoint=" + endpoint,
                                    "--rdzv_id=" + id, kCollective, "sum"};
  };
  Proc a(args()), b(args());
  auto ra = a.wait(120s);
  auto rb = b.wait(120s);
  INFO("agent a: " << a.err() << "\nagent b: " << b.err());
  CHECK(ra == 0);
  CHECK(rb == 0);
  CHECK(count_lines_with(a.out() + b.out(), "sum correct") == 4);
}

// rdzvd's idle size: with no client connected, after one real job (so that what any server
// keeps once it has served, its gRPC threads and their arenas, counts as idle).
void measure_idle(Daemon& d) {
  real_job_succeeds(d.endpoint, "warm-up");
  d.idle_kb = d.rss();
}

// After the attackers have gone: back within twice the idle size (glibc may keep a little).
void memory_comes_back(const Daemon& d) {
  const long bound = 2 * d.idle_kb;
  bool back = false;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  for (auto pause = 1ms; !back && std::chrono::steady_clock::now() < deadline;
       pause = std::min(pause * 2, 200ms)) {
    back = d.rss() <= bound;
    if (!back) std::this_thread::sleep_for(pause);
  }
  INFO("idle " << d.idle_kb << " kB, now " << d.rss() << " kB");
  CHECK(back);
  WARN("rdzvd RSS: idle " << d.idle_kb << " kB, after the attack " << d.rss() << " kB");
}

std::string random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>('a' + rng() % 26);
  return s;
}


}  // namespace

TEST_CASE("hostile: store writes to runs that never joined are refused and hold nothing",
          "[hostile]") {
  Daemon d;
  measure_idle(d);
  StoreStream s(connect(d.endpoint));
  const std::string big = random_bytes(4 << 20, 1);
  for (int i = 0; i < 200; ++i) {
    v1::StoreReply r = s.call(store_req("never-joined-" + std::to_string(i), v1::StoreRequest::SET,
                                        {"k"}, {big}));
    REQUIRE(r.code() == grpc::StatusCode::FAILED_PRECONDITION);
  }
  CHECK(status(d.endpoint).store().tables() == 0);
  CHECK(d.rss() <= d.idle_kb + kAttackSlackKb);
  real_job_succeeds(d.endpoint, "job-during-unknown");
  memory_comes_back(d);
  real_job_succeeds(d.endpoint, "job-after-unknown");
}

TEST_CASE("hostile: parked waits of clients that have gone are freed at once", "[hostile]") {
  Daemon d;
  measure_idle(d);
  HeldRun holder(d.endpoint, "victim");
  constexpr int kClients = 100;
  {
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    std::vector<std::unique_ptr<StoreStream>> waiters;
    for (int c = 0; c < kClients; ++c) {
      channels.push_back(connect(d.endpoint));
      waiters.push_back(std::make_unique<StoreStream>(channels.back()));
      std::vector<std::string> keys;
      for (int k = 0; k < 1000; ++k) keys.push_back(random_bytes(1000, c * 1000 + k));
      v1::StoreRequest r = store_req("victim", v1::StoreRequest::WAIT, std::move(keys));
      r.set_timeout_ms(3600 * 1000);
      REQUIRE(waiters.back()->send(r));
    }
    REQUIRE(eventually(d.endpoint, [](const v1::StatusReply& r) {
      return r.store().parked_waits() == kClients;
    }));
    CHECK(d.rss() <= d.idle_kb + kAttackSlackKb);
    real_job_succeeds(d.endpoint, "job-during-parked");
  }  // the clients go: their streams are cancelled and their connections closed
  CHECK(eventually(d.endpoint, [](const v1::StatusReply& r) { return r.store().parked_waits() == 0; }));
  memory_comes_back(d);
  real_job_succeeds(d.endpoint, "job-after-parked");
}

TEST_CASE("hostile: runs whose only node went silent are dropped", "[hostile]") {
  Daemon d;
  measure_idle(d);
  constexpr int kRuns = 300;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<Session>> sessions;
  for (int i = 0; i < kRuns; ++i) {
    if (i % 50 == 0) channels.push_back(connect(d.endpoint));
    sessions.push_back(std::make_unique<Session>(channels.back()));
    v1::AgentMsg m = join_msg("silent-" + std::to_string(i), 1, 1);
    m.mutable_join()->set_keep_alive_interval_ms(100);
    m.mutable_join()->set_keep_alive_max_attempt(1);
    REQUIRE(sessions.back()->send(m));
  }
  // Each gets its round, says nothing more, and is dropped for silence: its stream ends.
  for (auto& s : sessions) CHECK(s->end().error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(eventually(d.endpoint, [](const v1::StatusReply& r) { return !has_run(r, "silent-"); }));
  sessions.clear();
  channels.clear();
  memory_comes_back(d);
  real_job_succeeds(d.endpoint, "job-after-silent");
}

TEST_CASE("hostile: slow readers of large values hold bounded memory", "[hostile]") {
  Daemon d;
  measure_idle(d);
  HeldRun holder(d.endpoint, "victim");
  {
    StoreStream w(connect(d.endpoint));
    REQUIRE(w.call(store_req("victim", v1::StoreRequest::SET, {"big"},
                             {random_bytes(4 << 20, 7)})).code() == 0);
  }
  {
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    std::vector<std::unique_ptr<StoreStream>> readers;
    for (int i = 0; i < 150; ++i) {
      if (i % 50 == 0) channels.push_back(connect(d.endpoint, /*slow_reader=*/true));
      readers.push_back(std::make_unique<StoreStream>(channels.back()));
      REQUIRE(readers.back()->send(store_req("victim", v1::StoreRequest::GET, {"big"})));
    }
    real_job_succeeds(d.endpoint, "job-during-slow");
    const long during = d.rss();
    // Now read: the server answered as many as its budget of unread replies allows and
    // refused the rest (they may retry), rather than holding 150 copies of the value.
    int answered = 0, refused = 0;
    for (auto& r : readers) {
      const int code = r->recv().code();
      answered += code == 0;
      refused += code == grpc::StatusCode::RESOURCE_EXHAUSTED;
    }
    INFO("idle " << d.idle_kb << " kB, during " << during << " kB; answered " << answered
                 << ", refused " << refused);
    WARN("slow readers: rdzvd RSS idle " << d.idle_kb << " kB, during " << during
                                         << " kB; answered " << answered << ", refused " << refused);
    CHECK(answered + refused == 150);
    CHECK(answered <= static_cast<int>(limits::kMaxStoreUnreadReplyBytes / (4 << 20)));
    CHECK(during <= d.idle_kb + kAttackSlackKb);
  }
  memory_comes_back(d);
  real_job_succeeds(d.endpoint, "job-after-slow");
}

TEST_CASE("hostile: oversized joins end their stream and hold nothing", "[hostile]") {
  Daemon d;
  measure_idle(d);
  auto ch = connect(d.endpoint);
  for (std::size_t size : {limits::kMaxAgentMessageBytes + 1, std::size_t{7} << 20}) {
    for (int i = 0; i < 20; ++i) {
      Session s(ch);
      v1::AgentMsg m = join_msg("big-join", 2, 2, random_bytes(size, i));
      s.send(m);
      CHECK(s.end().error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    }
  }
  CHECK(!has_run(status(d.endpoint), "big-join"));
  memory_comes_back(d);
  real_job_succeeds(d.endpoint, "job-after-big-join");
}

TEST_CASE("hostile: a stream that joins a second run leaves no ghost in the first",
          "[hostile]") {
  Daemon d;
  Session ghost(connect(d.endpoint));
  v1::AgentMsg a = join_msg("ghost-job", 2, 2);
  a.mutable_join()->set_last_call_timeout_ms(std::numeric_limits<std::int64_t>::max());
  a.mutable_join()->set_keep_alive_interval_ms(std::numeric_limits<std::int64_t>::max());
  REQUIRE(ghost.send(a));
  REQUIRE(ghost.send(join_msg("elsewhere", 1, 1)));
  CHECK(ghost.end().error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  // The real job of that id forms its own round of two and finishes.
  real_job_succeeds(d.endpoint, "ghost-job");
}

TEST_CASE("hostile: huge durations and deltas saturate or are refused, never wrap",
          "[hostile]") {
  Daemon d;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  SECTION("a huge keep-alive does not drop the node at once") {
    Session s(connect(d.endpoint));
    v1::AgentMsg m = join_msg("huge-keepalive", 1, 1);
    m.mutable_join()->set_keep_alive_interval_ms(kMax);
    m.mutable_join()->set_keep_alive_max_attempt(std::numeric_limits<std::int32_t>::max());
    REQUIRE(s.send(m));
    v1::ServerMsg got;
    REQUIRE(s.read(&got));
    REQUIRE(got.has_assignment());
    v1::AgentMsg done;
    done.mutable_success()->set_round(got.assignment().round());
    REQUIRE(s.send(done));
    REQUIRE(s.read(&got));
    CHECK(got.has_done());
  }
  SECTION("a huge join timeout waits for the second node") {
    Session first(connect(d.endpoint)), second(connect(d.endpoint));
    v1::AgentMsg m = join_msg("huge-join-timeout", 2, 2, "n1");
    m.mutable_join()->set_join_timeout_ms(10000000000000LL);
    REQUIRE(first.send(m));
    REQUIRE(eventually(d.endpoint, [](const v1::StatusReply& r) { return has_run(r, "huge-join"); }));
    REQUIRE(second.send(join_msg("huge-join-timeout", 2, 2, "n2")));
    v1::ServerMsg got;
    REQUIRE(first.read(&got));
    CHECK(got.has_assignment());
    REQUIRE(second.read(&got));
    CHECK(got.has_assignment());
  }
  SECTION("a get with a huge timeout waits; add refuses to wrap") {
    HeldRun holder(d.endpoint, "huge-store");
    auto ch = connect(d.endpoint);
    StoreStream getter(ch), setter(ch);
    v1::StoreRequest get = store_req("huge-store", v1::StoreRequest::GET, {"late"});
    get.set_timeout_ms(kMax);
    REQUIRE(getter.send(get));
    REQUIRE(eventually(d.endpoint, [](const v1::StatusReply& r) { return r.store().parked_waits() == 1; }));
    REQUIRE(setter.call(store_req("huge-store", v1::StoreRequest::SET, {"late"}, {"here"})).code() == 0);
    v1::StoreReply r = getter.recv();
    CHECK(r.code() == 0);
    REQUIRE(r.values_size() == 1);
    CHECK(r.values(0) == "here");

    v1::StoreRequest add = store_req("huge-store", v1::StoreRequest::ADD, {"n"});
    add.set_delta(kMax);
    REQUIRE(setter.call(add).code() == 0);
    add.set_delta(1);
    v1::StoreReply wrapped = setter.call(add);
    CHECK(wrapped.code() != 0);
    CHECK(!wrapped.error().empty());
    v1::StoreReply value = setter.call(store_req("huge-store", v1::StoreRequest::GET, {"n"}));
    REQUIRE(value.values_size() == 1);
    CHECK(value.values(0) == std::to_string(kMax));
  }
  real_job_succeeds(d.endpoint, "job-after-huge");
}

TEST_CASE("hostile: multi_set at the key limit writes nothing", "[hostile]") {
  Daemon d;
  measure_idle(d);
  HeldRun holder(d.endpoint, "full");
  StoreStream s(connect(d.endpoint));
  const int limit = static_cast<int>(limits::kMaxStoreKeysPerRun);
  for (int start = 0; start < limit - 1; start += 10000) {
    std::vector<std::string> keys, values;
    for (int i = start; i < std::min(start + 10000, limit - 1); ++i) {
      keys.push_back("k" + std::to_string(i));
      values.push_back("v");
    }
    REQUIRE(s.call(store_req("full", v1::StoreRequest::MULTI_SET, keys, values)).code() == 0);
  }
  v1::StoreReply r = s.call(store_req("full", v1::StoreRequest::MULTI_SET, {"new1", "new2"}, {"a", "b"}));
  CHECK(r.code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  v1::StoreReply n = s.call(store_req("full", v1::StoreRequest::NUM_KEYS, {}));
  CHECK(n.number() == limit - 1);
  v1::StoreReply first = s.call(store_req("full", v1::StoreRequest::CHECK, {"new1"}));
  CHECK_FALSE(first.flag());
  CHECK(d.rss() <= d.idle_kb + kAttackSlackKb);
  real_job_succeeds(d.endpoint, "job-beside-full");
}

TEST_CASE("hostile: invalid UTF-8 ids get INVALID_ARGUMENT with a message", "[hostile]") {
  Daemon d;
  Session s(connect(d.endpoint));
  REQUIRE(s.send(join_msg("bad\xff\xfe", 1, 1)));
  grpc::Status st = s.end();
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(!st.error_message().empty());
  StoreStream store(connect(d.endpoint));
  v1::StoreReply r = store.call(store_req("bad\xc0\xaf", v1::StoreRequest::SET, {"k"}, {"v"}));
  CHECK(r.code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(!r.error().empty());
  real_job_succeeds(d.endpoint, "job-after-utf8");
}

TEST_CASE("hostile: a waiter on a huge key list does not stop another run", "[hostile]") {
  Daemon d;
  measure_idle(d);
  HeldRun holder(d.endpoint, "hog");
  auto ch = connect(d.endpoint);
  StoreStream hog(ch);
  std::vector<std::string> keys;
  for (int i = 0; i < 60000; ++i) keys.push_back("missing/" + std::to_string(i) + random_bytes(24, i));
  v1::StoreRequest w = store_req("hog", v1::StoreRequest::WAIT, keys);
  w.set_timeout_ms(3600 * 1000);
  REQUIRE(hog.send(w));
  REQUIRE(eventually(d.endpoint, [](const v1::StatusReply& r) { return r.store().parked_waits() == 1; }));
  real_job_succeeds(d.endpoint, "job-beside-hog");
  // More keys in one request than the limit: refused, not parked.
  StoreStream greedy(ch);
  std::vector<std::string> many(limits::kMaxStoreKeysPerRequest + 1, "x");
  v1::StoreRequest g = store_req("hog", v1::StoreRequest::WAIT, many);
  g.set_timeout_ms(1000);
  const int code = greedy.call(g).code();
  CHECK((code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::RESOURCE_EXHAUSTED));
  CHECK(d.rss() <= d.idle_kb + kAttackSlackKb);
}
