// A node's ADDs and WAITs combined by its agent (store_relay.h): one ADD of their sum per key
// in flight, one WAIT per key set at the server, over a real rdzvd and real sockets. The
// server is stopped (SIGSTOP) where a test needs queries to meet at the agent: the ADD in
// flight then stays unanswered until SIGCONT.
#include <signal.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "held_run.h"
#include "helpers.h"
#include "rdzvd_proc.h"
#include "store_relay_helpers.h"
#include "tcpstore_client.h"

using namespace muster::testing;
using muster::rendezvous::StoreRelay;
using muster::rendezvous::StoreRelayOptions;
using Dialect = muster::rendezvous::tcpstore::Dialect;
using Op = muster::rendezvous::tcpstore::Op;
namespace wire = muster::rendezvous::tcpstore;

namespace {

// Whether every thread of process `pid` is stopped (state T in /proc/PID/task/*/stat).
bool all_stopped(int pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(dir, ec)) {
    std::ifstream f(t.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'T') {
      return false;
    }
  }
  return !ec;
}

// The rdzvd of a test, stopped and continued (SIGSTOP/SIGCONT: its sockets stay open). The
// stop is asynchronous: a thread of a loaded machine may still serve a query after kill()
// returns, so the constructor waits until every thread is stopped.
struct Paused {
  explicit Paused(int pid) : pid(pid) {
    ::kill(pid, SIGSTOP);
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (!all_stopped(pid) && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(1ms);
    }
    REQUIRE(all_stopped(pid));
  }
  ~Paused() { resume(); }
  void resume() {
    if (std::exchange(stopped, false)) ::kill(pid, SIGCONT);
  }
  void killed() { stopped = false; }  // ended while stopped: nothing to continue
  int pid;
  bool stopped = true;
};

std::string add_frame(Dialect d, const std::string& key, std::int64_t delta) {
  auto r = TcpStoreClient::req(Op::kAdd, {key});
  r.delta = delta;
  return wire::encode(d, r);
}

}  // namespace

TEST_CASE_METHOD(TwoAgentsPatient,
                 "store relay: a node's ADDs of one key go up as one ADD of their sum, each "
                 "answered as if alone, and their WAITs ride on one",
                 "[store_relay]") {
  const int port = world(*a, 1);
  TcpStoreClient first(port, Dialect::kTorch2);
  REQUIRE(first.add("n", 1) == 1);  // the world is open on the server; the first ADD alone
  constexpr int kRanks = 24;
  std::vector<std::unique_ptr<TcpStoreClient>> ranks;
  for (int i = 0; i < kRanks; ++i) {
    ranks.push_back(std::make_unique<TcpStoreClient>(port, i % 2 ? Dialect::kTorch1 : Dialect::kTorch2));
    REQUIRE(ranks.back()->ok());
  }
  {
    Paused stopped(server.proc->pid());
    // Rank 0's ADD goes up and is not answered while the server is stopped: the others' meet
    // behind it. Each pipelines its WAIT after its ADD, as a barrier does.
    auto barrier = [&](int i) {
      const Dialect d = i % 2 ? Dialect::kTorch1 : Dialect::kTorch2;
      return ranks[static_cast<std::size_t>(i)]->send_raw(
          add_frame(d, "n", i + 1) + wire::encode(d, TcpStoreClient::req(Op::kWait, {"go"})));
    };
    REQUIRE(barrier(0));
    REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.combined_adds == 2; }));
    for (int i = 1; i < kRanks; ++i) REQUIRE(barrier(i));
    REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.adds_held == kRanks; }));
    CHECK(a->stats().combined_adds == 2);  // the others wait for rank 0's answer
  }
  // Each got what it would have had alone, in some order: 1 + the deltas before its own.
  std::vector<std::int64_t> got;
  for (auto& r : ranks) {
    auto v = r->read_value<std::int64_t>(10s);
    REQUIRE(v);
    got.push_back(*v);
  }
  const std::int64_t total = 1 + kRanks * (kRanks + 1) / 2;
  CHECK(*std::max_element(got.begin(), got.end()) == total);
  for (int i = 0; i < kRanks; ++i) {  // rank i's value less its delta: a value another saw
    const std::int64_t before = got[static_cast<std::size_t>(i)] - (i + 1);
    CHECK((before == 1 || std::count(got.begin(), got.end(), before) == 1));
  }
  std::sort(got.begin(), got.end());
  CHECK(std::adjacent_find(got.begin(), got.end()) == got.end());
  const StoreRelay::Stats s = a->stats();
  CHECK(s.combined_adds == 3);  // the first one's, rank 0's, and the other ranks' together
  CHECK(s.adds_combined == kRanks + 1);
  CHECK(s.adds_held == 0);
  // The server's counter agrees (another node's ADD of 0).
  TcpStoreClient other(world(*b, 1), Dialect::kTorch1);
  CHECK(other.add("n", 0) == total);
  // Their WAITs: one at the server, the others ride on it; a SET on the other node answers
  // all of them, and torch's GET after its WAIT is answered with the value that came.
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.waits_joined == kRanks - 1; }));
  REQUIRE(other.set("go", "now"));
  for (auto& r : ranks) {
    CHECK(r->read_u8(10s) == wire::kStopWaiting);
    CHECK(r->get("go") == "now");
  }
  CHECK(a->stats().gets_answered_here == kRanks);
}

TEST_CASE_METHOD(TwoAgents,
                 "store relay: the connection whose WAIT others ride on goes or cancels it: one "
                 "of them asks in its place, and one that sends more asks for itself",
                 "[store_relay]") {
  const int port = world(*a, 1);
  TcpStoreClient setter(world(*b, 1), Dialect::kTorch2);
  auto leader = std::make_unique<TcpStoreClient>(port, Dialect::kTorch2);
  TcpStoreClient cancels(port, Dialect::kTorch1), rides(port, Dialect::kTorch2),
      stays(port, Dialect::kTorch1);
  REQUIRE(leader->send(TcpStoreClient::req(Op::kWait, {"k"})));
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.waits_sent == 1; }));
  REQUIRE(cancels.send(TcpStoreClient::req(Op::kWait, {"k"})));
  REQUIRE(rides.send(TcpStoreClient::req(Op::kWait, {"k"})));
  REQUIRE(stays.send(TcpStoreClient::req(Op::kWait, {"k"})));
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.waits_joined == 3; }));
  CHECK(a->stats().waits_sent == 1);
  // The leader goes: one that rode on it now waits at the server in its place.
  leader.reset();
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.waits_sent == 2; }));
  // One of the three cancels its WAIT (torch 2.x after its timeout), whether it leads now or
  // rides: it is cancelled, the others still wait.
  REQUIRE(cancels.send(TcpStoreClient::req(Op::kCancelWait, {})));
  CHECK(cancels.read_u8(10s) == wire::kWaitCanceled);
  CHECK(cancels.add("other", 1) == 1);  // and the connection goes on
  REQUIRE(setter.set("k", "v"));
  CHECK(rides.read_u8(10s) == wire::kStopWaiting);
  CHECK(stays.read_u8(10s) == wire::kStopWaiting);
  CHECK(rides.get("k") == "v");
  CHECK(stays.get("k") == "v");
  CHECK(a->stats().closed_for_errors == 0);
}

TEST_CASE_METHOD(TwoServers,
                 "store relay: a combined ADD in flight when the server is lost closes its "
                 "workers' connections, the ADDs behind it go to the next server",
                 "[store_relay]") {
  TcpStoreClient warm(port, Dialect::kTorch2), flying(port, Dialect::kTorch2),
      behind(port, Dialect::kTorch1);
  REQUIRE(warm.add("n", 10) == 10);
  Paused stopped(first.proc->pid());  // SIGKILL below ends it stopped
  REQUIRE(flying.send_raw(add_frame(Dialect::kTorch2, "n", 1)));
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.combined_adds == 2; }));
  REQUIRE(behind.send_raw(add_frame(Dialect::kTorch1, "n", 100)));
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.adds_held == 2; }));
  first.kill9();
  stopped.killed();
  // Nobody can say whether the first server served the ADD in flight: its connection is
  // closed. This node's writes are written again on the second (10, and the 1 that may have
  // been served), then the ADD behind it.
  CHECK(flying.closed_by_server(10s));
  CHECK(behind.read_value<std::int64_t>(10s) == 111);
  CHECK(a->stats().adds_held == 0);
  CHECK(warm.add("n", 0) == 111);
}

TEST_CASE_METHOD(TwoAgentsPatient,
                 "store relay: a combined ADD the server refuses closes its workers' "
                 "connections, the ADDs sent after it on the same connection go again",
                 "[store_relay]") {
  const int port = world(*a, 1);
  TcpStoreClient bad(port, Dialect::kTorch2), good(port, Dialect::kTorch1);
  REQUIRE(bad.set("s", "not a number"));
  REQUIRE(good.add("n", 0) == 0);  // the SET is at the server, the agent's ADD connection open
  {
    Paused stopped(server.proc->pid());
    REQUIRE(bad.send_raw(add_frame(Dialect::kTorch2, "s", 1)));
    REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.combined_adds == 2; }));
    REQUIRE(good.send_raw(add_frame(Dialect::kTorch1, "n", 5)));
    REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.combined_adds == 3; }));
  }
  // torch's rule: an ADD to a value that is not a number ends that connection.
  CHECK(bad.closed_by_server(10s));
  CHECK(good.read_value<std::int64_t>(10s) == 5);
  CHECK(good.add("n", 0) == 5);  // served once
  TcpStoreClient other(world(*b, 1), Dialect::kTorch2);
  CHECK(other.get("s") == "not a number");
}

TEST_CASE("store relay: with combining off, each ADD and WAIT goes to the server as it came",
          "[store_relay]") {
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  StoreRelayOptions o;
  o.combine = false;
  auto a = relay({server.endpoint}, "job", "", o);
  const int port = world(*a, 1);
  TcpStoreClient x(port, Dialect::kTorch2), y(port, Dialect::kTorch1);
  CHECK(x.add("n", 1) == 1);
  CHECK(y.add("n", 2) == 3);
  REQUIRE(x.send(TcpStoreClient::req(Op::kWait, {"go"})));
  REQUIRE(y.send(TcpStoreClient::req(Op::kWait, {"go"})));
  REQUIRE(y.set("go", "1"));
  CHECK(x.read_u8(10s) == wire::kStopWaiting);
  CHECK(y.read_u8(10s) == wire::kStopWaiting);
  const StoreRelay::Stats s = a->stats();
  CHECK(s.combined_adds == 0);
  CHECK(s.waits_joined == 0);
  CHECK(s.waits_sent == 2);
}
