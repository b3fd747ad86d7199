// The run's TCPStore-protocol store as agents serve it (store_relay.h): each agent's loopback
// listener per world, the queries carried to the server's world tables (relay_service.h), over
// real rdzvd processes and real sockets. What torch's own client does through it is in the
// interop tests; what a whole job does is in launch_test, security_test and hosts_test.
#include <poll.h>

#include <netinet/in.h>
#include <signal.h>
#include <sys/fsuid.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "client/peer_uid.h"
#include "held_run.h"
#include "helpers.h"
#include "muster/rendezvous/store_relay.h"
#include "rdzvd_proc.h"
#include "skip.h"
#include "store_relay_helpers.h"
#include "tcpstore_client.h"

using namespace muster::testing;
using muster::rendezvous::StoreRelay;
using muster::rendezvous::StoreRelayOptions;
using Dialect = muster::rendezvous::tcpstore::Dialect;
using Op = muster::rendezvous::tcpstore::Op;

namespace {

}  // namespace

TEST_CASE_METHOD(TwoAgents,
                 "store relay: two nodes' agents share a world's table, and torch's get is "
                 "answered from the WAIT",
                 "[store_relay]") {
  TcpStoreClient on_a(world(*a, 1), Dialect::kTorch2);
  TcpStoreClient on_b(world(*b, 1), Dialect::kTorch1);
  REQUIRE(on_a.ok());
  REQUIRE(on_b.ok());
  REQUIRE(on_a.set("/worker/0", "addr-of-0"));
  // torch's get(): WAIT, then GET of the key; the value came with the WAIT's answer.
  REQUIRE(wait_for(on_b, "/worker/0"));
  CHECK(on_b.get("/worker/0") == "addr-of-0");
  CHECK(b->stats().gets_answered_here == 1);
  // A GET that does not follow its WAIT goes to the server (a later write is seen).
  REQUIRE(on_a.set("/worker/0", "moved"));
  CHECK(on_a.add("n", 2) == 2);  // the SET has reached the table (it has no answer of its own)
  REQUIRE(wait_for(on_b, "/worker/0"));
  CHECK(on_b.add("n", 1) == 3);  // a query between: the value held is dropped
  CHECK(on_b.get("/worker/0") == "moved");
  // A WAIT parked through one agent is answered by a write through the other.
  REQUIRE(on_b.send(TcpStoreClient::req(Op::kWait, {"late"})));
  REQUIRE(on_a.set("late", "here"));
  CHECK(on_b.read_u8(10s) == muster::rendezvous::tcpstore::kStopWaiting);
  CHECK(a->stats().streams == 1);
  CHECK(a->stats().closed_for_errors == 0);
}

TEST_CASE_METHOD(TwoAgents,
                 "store relay: an agent answers reads of what its node set and another node's "
                 "write reaches it before anything that follows from that write",
                 "[store_relay]") {
  TcpStoreClient a1(world(*a, 1), Dialect::kTorch2);
  TcpStoreClient a2(world(*a, 1), Dialect::kTorch1);
  TcpStoreClient b1(world(*b, 1), Dialect::kTorch2);
  REQUIRE((a1.ok() && a2.ok() && b1.ok()));
  REQUIRE(a1.set("k", "1"));
  // torch's get() on the node that set it, by the setter and by another worker of the node.
  REQUIRE(wait_for(a1, "k"));
  CHECK(a1.get("k") == "1");
  REQUIRE(wait_for(a2, "k"));
  CHECK(a2.get("k") == "1");
  CHECK(a2.check({"k"}) == true);
  CHECK(a->stats().reads_answered_here == 5);
  // Another node reads it from the server.
  REQUIRE(wait_for(b1, "k"));
  CHECK(b1.get("k") == "1");
  CHECK(b->stats().reads_answered_here == 0);

  // b writes the key, then a key a waits on: once a sees the second, it reads b's value.
  REQUIRE(b1.set("k", "2"));
  REQUIRE(b1.set("done", "yes"));
  REQUIRE(wait_for(a2, "done"));
  CHECK(a2.get("done") == "yes");
  CHECK(a1.get("k") == "2");
  CHECK(a->stats().reads_answered_here == 5);
  // a writes it again and holds it again. A SET has no reply: what orders it before another
  // node's read is the store (here an ADD through each node after it), as with torch's own.
  REQUIRE(a1.set("k", "3"));
  CHECK(a2.get("k") == "3");
  CHECK(a->stats().reads_answered_here == 6);
  REQUIRE(a1.add("sync", 1) == 1);
  REQUIRE(b1.add("sync", 1) == 2);
  CHECK(b1.get("k") == "3");
  CHECK(b->stats().reads_answered_here == 0);

  // A write whose value a cannot know forgets the key at once: a read after it is the server's.
  REQUIRE(a1.set("n", "5"));
  CHECK(a2.add("n", 1) == 6);
  CHECK(a1.get("n") == "6");
  // Another node deletes what a set: a's WAIT then parks until the key comes back.
  REQUIRE(a1.set("gone", "x"));
  REQUIRE(a1.add("sync", 1) == 3);
  REQUIRE(b1.send(TcpStoreClient::req(Op::kDelete, {"gone"})));
  REQUIRE(b1.read_value<std::int64_t>() == 1);
  REQUIRE(b1.set("after", "1"));
  REQUIRE(wait_for(a2, "after"));
  CHECK(a2.check({"gone"}) == false);
  CHECK(a->stats().reads_answered_here == 6);
  CHECK(a->stats().closed_for_errors == 0);
  CHECK(b->stats().closed_for_errors == 0);
}

// torch's own client through an agent that answers its node's reads itself: the conformance
// script that torch's own server passes (tcpstore_test.cc) passes here too.
TEST_CASE("store relay: torch's own TCPStore client passes the conformance script through "
          "an agent",
          "[store_relay][interop]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (python3-torch)");
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  auto a = relay({server.endpoint}, "job");
  Proc py({kPython, std::string(INTEROP_SCRIPTS_DIR) + "/tcpstore_conformance.py",
           "127.0.0.1", std::to_string(world(*a, 1))});
  const auto rc = py.wait(120s);
  INFO(py.out() << py.err());
  REQUIRE(rc == 0);
  CHECK_THAT(py.out(), Catch::Contains("conformance: ok"));
  CHECK(a->stats().reads_answered_here > 0);
  // The one ADD to a non-integer closed that client's connection; nothing else did.
  CHECK(a->stats().closed_for_errors == 1);
}

// A SET waits in the agent for company (write-behind) at most limits::kRelayWriteBehind; a
// query that goes up meanwhile takes it along and calls the timer off. A SET of another
// connection that comes in the same turn of the agent's loop still needs the timer.
TEST_CASE_METHOD(TwoAgents,
                 "store relay: a lone SET reaches the other nodes though another connection's "
                 "query called the write-behind timer off just before it",
                 "[store_relay]") {
  TcpStoreClient reader(world(*a, 1), Dialect::kTorch2), writer(world(*a, 1), Dialect::kTorch2);
  TcpStoreClient other(world(*b, 1), Dialect::kTorch2);
  for (int i = 0; i < 30; ++i) {
    const std::string k = "k" + std::to_string(i);
    REQUIRE(writer.set("held" + std::to_string(i), "x"));  // held back: the timer is armed
    // Both in one turn of the loop, as far as the test can make it: the GET goes up at once
    // (with the held SET), the SET after it is held back again.
    REQUIRE(reader.send(TcpStoreClient::req(Op::kGet, {"nobody's"})));
    REQUIRE(writer.set(k, "v"));
    REQUIRE(reader.read_bytes() == "");
    // Nothing more from node a: the SET must go up on its own.
    REQUIRE(other.send(TcpStoreClient::req(Op::kWait, {k})));
    INFO("round " << i);
    REQUIRE(other.read_u8(2s) == muster::rendezvous::tcpstore::kStopWaiting);
  }
}

// A node whose workers keep their agent busy with queries it answers itself (set+get of their
// own keys, no pause) still sends its SETs up: write_behind_max after they came. The shorter
// wait that sends a lone SET (write_behind) is made longer than the test here, so only the
// bound can.
TEST_CASE("store relay: a SET reaches the other nodes while its node keeps its agent busy",
          "[store_relay]") {
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  StoreRelayOptions o;
  o.write_behind = std::chrono::hours(1);
  auto a = relay({server.endpoint}, "job", "", o);
  auto b = relay({server.endpoint}, "job");
  TcpStoreClient busy(world(*a, 1), Dialect::kTorch2), other(world(*b, 1), Dialect::kTorch2);
  REQUIRE(busy.set("k", "v"));
  REQUIRE(other.send(TcpStoreClient::req(Op::kWait, {"k"})));
  std::optional<std::uint8_t> got;
  int i = 0;
  for (const auto end = std::chrono::steady_clock::now() + 20s;
       !got && std::chrono::steady_clock::now() < end; ++i) {
    const std::string own = "own" + std::to_string(i);
    REQUIRE(busy.set(own, "x"));
    REQUIRE(busy.get(own) == "x");  // answered by agent a: nothing goes up
    pollfd p{other.fd(), POLLIN, 0};
    if (::poll(&p, 1, 0) == 1) got = other.read_u8();
  }
  INFO(i << " set+get pairs");
  REQUIRE(got == muster::rendezvous::tcpstore::kStopWaiting);
  CHECK(a->stats().reads_answered_here >= static_cast<std::uint64_t>(i));
}

TEST_CASE("store relay: with the cache off, every read of a node's own keys goes to the server",
          "[store_relay]") {
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  StoreRelayOptions o;
  o.cache = false;
  auto a = relay({server.endpoint}, "job", "", o);
  TcpStoreClient a1(world(*a, 1), Dialect::kTorch2);
  REQUIRE(a1.set("k", "1"));
  CHECK(a1.get("k") == "1");
  CHECK(a1.check({"k"}) == true);
  CHECK(a->stats().reads_answered_here == 0);
}

// Issue 38: a world formed after a node left or joined has the restart count of the one
// before, so torch's own keys (/worker/attempt_<N>/...) have the same names: each round's
// world gets a table (and, on each agent, a listener) of its own.
TEST_CASE("store relay: each round of a run has a store of its own, the two newest are kept",
          "[store_relay]") {
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  auto a = relay({server.endpoint}, "job");
  const int p1 = world(*a, 1);
  CHECK(world(*a, 1) == p1);
  TcpStoreClient old_world(p1, Dialect::kTorch1);
  REQUIRE(old_world.set("/worker/attempt_0/rank_1", "the old world's address"));
  REQUIRE(old_world.get("/worker/attempt_0/rank_1") == "the old world's address");

  const int p2 = world(*a, 2);
  CHECK(p2 != p1);
  TcpStoreClient new_world(p2, Dialect::kTorch2);
  CHECK(new_world.check({"/worker/attempt_0/rank_1"}) == false);  // not the old world's keys
  REQUIRE(new_world.set("/worker/attempt_0/rank_1", "the new world's"));
  CHECK(old_world.get("/worker/attempt_0/rank_1") == "the old world's address");

  // A third round closes the first: its connections end, its port refuses, its round is gone,
  // on the agent and (once the third world is named to it) on the server.
  TcpStoreClient third(world(*a, 3), Dialect::kTorch2);
  REQUIRE(third.set("k", "3"));
  REQUIRE(third.get("k") == "3");
  CHECK(old_world.closed_by_server());
  CHECK_FALSE(TcpStoreClient(p1, Dialect::kTorch2).ok());
  CHECK_FALSE(a->world(1).ok());
  CHECK(new_world.get("/worker/attempt_0/rank_1") == "the new world's");
  // Another node that still names round 1 (a straggler of the old world) gets no table.
  auto late = relay({server.endpoint}, "job");
  TcpStoreClient stale(world(*late, 1), Dialect::kTorch2);
  REQUIRE(stale.ok());
  stale.set("k", "v");
  CHECK(stale.closed_by_server());
}

TEST_CASE("store relay: a run that goes with many connections open ends every one of them with "
          "one log line on the server, not one per connection",
          "[store_relay]") {
  RdzvdProc server;
  auto run = std::make_unique<HeldRun>(server.endpoint, "job");
  // Each ADD on a connection of its own at the server (combined, they would share one).
  StoreRelayOptions alone;
  alone.combine = false;
  auto a = relay({server.endpoint}, "job", "", alone);
  const int p1 = world(*a, 1);
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  for (int i = 0; i < 40; ++i) {
    clients.push_back(std::make_unique<TcpStoreClient>(p1, Dialect::kTorch2));
    REQUIRE(clients.back()->add("n", 1) == i + 1);  // each is on the server's table
  }
  run.reset();
  for (auto& c : clients) CHECK(c->closed_by_server());
  // 100,000 ranks would otherwise be 100,000 lines, each a write the store's thread waits on.
  const bool said = server.proc->wait_output(
      out_has("store relay: closed 40 connection(s) of run 'job', round 1: its world (round 1) "
              "was closed"),
      10s);
  INFO(server.proc->out());
  CHECK(said);
  CHECK(count_lines_with(server.proc->out(), "store relay: closed") == 1);
}

TEST_CASE("store relay: a token that does not open the run ends the workers' connections, "
          "with one line",
          "[store_relay]") {
  TempDir dir;
  const std::string tokens = dir.file("tokens");
  std::ofstream(tokens) << "job right-token\n";
  RdzvdProc server({"--token_file", tokens});
  HeldRun run(server.endpoint, "job", 1, 1, "right-token");
  auto wrong = relay({server.endpoint}, "job", "wrong-token");
  TcpStoreClient c(world(*wrong, 1), Dialect::kTorch2);
  REQUIRE(c.ok());
  c.set("k", "v");
  CHECK(c.closed_by_server());
  auto right = relay({server.endpoint}, "job", "right-token");
  TcpStoreClient ok(world(*right, 1), Dialect::kTorch2);
  REQUIRE(ok.set("k", "v"));
  CHECK(ok.get("k") == "v");
}

TEST_CASE("store relay: a connection from another user's process is refused", "[store_relay]") {
  if (::geteuid() != 0) MUSTER_SKIP("needs root, to run a client as nobody");
  if (::access("/usr/sbin/runuser", X_OK) != 0) MUSTER_SKIP("needs runuser");
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  auto a = relay({server.endpoint}, "job");
  const int port = world(*a, 1);
  // torch 1.13's GET of "k" after a SET: a client that got in would read "v" back.
  const std::string script =
      "import socket, struct, sys\n"
      "s = socket.create_connection(('127.0.0.1', " + std::to_string(port) + "))\n"
      "def b(x): return struct.pack('=Q', len(x)) + x\n"
      "s.sendall(bytes([0]) + b(b'k') + b(b'v') + bytes([2]) + b(b'k'))\n"
      "s.settimeout(10)\n"
      "try:\n  got = s.recv(64)\nexcept OSError:\n  got = b''\n"
      "print('read', len(got))\n";
  Proc nobody({"/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", script});
  REQUIRE(nobody.wait(30s) == 0);
  CHECK(nobody.out().find("read 0") != std::string::npos);
  CHECK(a->stats().refused_other_user == 1);
  // The agent's own user gets in, and the other one's SET never reached the table.
  TcpStoreClient mine(port, Dialect::kTorch1);
  CHECK(mine.check({"k"}) == false);
}

TEST_CASE_METHOD(TwoServers,
                 "store relay: a lost server: keys written again to the next one, a parked WAIT "
                 "answered there",
                 "[store_relay]") {
  TcpStoreClient writer(port, Dialect::kTorch2), waiter(port, Dialect::kTorch1);
  REQUIRE(writer.set("addr/0", "10.0.0.1"));
  REQUIRE(writer.add("count", 2) == 2);
  REQUIRE(writer.add("count", 3) == 5);
  REQUIRE(waiter.send(TcpStoreClient::req(Op::kWait, {"go"})));
  REQUIRE(writer.add("count", 0) == 5);  // everything before has been served
  first.kill9();
  // On the second server: what this node wrote (another node reads it there), and the WAIT
  // still parked.
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.replayed_writes == 2; }));
  auto b = relay({second.endpoint}, "job");
  TcpStoreClient on_b(world(*b, 1), Dialect::kTorch1);
  CHECK(on_b.get("addr/0") == "10.0.0.1");
  CHECK(writer.get("addr/0") == "10.0.0.1");
  CHECK(writer.add("count", 0) == 5);
  REQUIRE(writer.set("go", "1"));
  CHECK(waiter.read_u8(10s) == muster::rendezvous::tcpstore::kStopWaiting);
  CHECK(a->stats().streams >= 2);
  CHECK(a->stats().closed_for_errors == 0);
}

TEST_CASE("store relay: rdzvd serves many runs' tables on one shared thread, closed with the run",
          "[store_relay]") {
  RdzvdProc server;
  auto threads_of = [](pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
    }
    return -1;
  };
  std::vector<std::unique_ptr<HeldRun>> runs;
  std::vector<std::unique_ptr<StoreRelay>> relays;
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  for (int i = 0; i < 40; ++i) {
    const std::string id = "run-" + std::to_string(i);
    runs.push_back(std::make_unique<HeldRun>(server.endpoint, id));
    relays.push_back(relay({server.endpoint}, id));
    clients.push_back(std::make_unique<TcpStoreClient>(world(*relays.back(), 1), Dialect::kTorch2));
    REQUIRE(clients.back()->set("k", id));
    if (i == 0) REQUIRE(clients[0]->get("k") == "run-0");
  }
  const int threads_one = threads_of(server.proc->pid());
  for (int i = 0; i < 40; ++i) CHECK(clients[i]->get("k") == "run-" + std::to_string(i));
  CHECK(threads_of(server.proc->pid()) <= threads_one + 4);
  // A run that goes takes its tables: its workers' connections are closed.
  runs.pop_back();
  CHECK(clients.back()->closed_by_server());
  CHECK(clients.front()->get("k") == "run-0");
}

TEST_CASE("store relay: a server gone silent (no FIN, no RST) is left within seconds, the "
          "parked WAIT answered by the next one",
          "[store_relay]") {
  RdzvdProc first, second;
  HeldRun on_first(first.endpoint, "job");
  HeldRun on_second(second.endpoint, "job");
  Proc proxy({FAULT_PROXY_BIN, "--listen", "127.0.0.1:0", "--target", first.endpoint});
  REQUIRE(proxy.wait_output(
      [](const std::string& o, const std::string&) {
        return o.find("listening on ") != std::string::npos && o.back() == '\n';
      },
      10s));
  std::smatch m;
  const std::string said = proxy.out();
  REQUIRE(std::regex_search(said, m, std::regex("listening on (\\d+)")));
  auto a = relay({"127.0.0.1:" + m[1].str(), second.endpoint}, "job");
  const int port = world(*a, 1);
  TcpStoreClient writer(port, Dialect::kTorch2), waiter(port, Dialect::kTorch2);
  REQUIRE(writer.set("addr/0", "10.0.0.1"));
  REQUIRE(waiter.send(TcpStoreClient::req(Op::kWait, {"go"})));
  REQUIRE(writer.get("addr/0") == "10.0.0.1");
  const auto cut = std::chrono::steady_clock::now();
  ::kill(proxy.pid(), SIGUSR1);
  REQUIRE(proxy.wait_output(out_has("blackhole on"), 10s));
  REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.replayed_writes == 1; }));
  const auto moved = std::chrono::steady_clock::now() - cut;
  INFO("moved after " << std::chrono::duration_cast<std::chrono::milliseconds>(moved).count()
                      << " ms");
  CHECK(moved < 4s);  // keep-alive: a ping every 1 s, 1 s to answer (limits.h)
  CHECK(writer.get("addr/0") == "10.0.0.1");
  REQUIRE(writer.set("go", "1"));
  CHECK(waiter.read_u8(10s) == muster::rendezvous::tcpstore::kStopWaiting);
  ::kill(proxy.pid(), SIGTERM);
  CHECK(proxy.wait(10s) == 0);
}

TEST_CASE("store relay: the agent's listener is bounded as the server's: lengths that lie, "
          "half-sent frames, connections, replies not read",
          "[store_relay][limits]") {
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  StoreRelayOptions o;
  o.partial_frame_timeout = 300ms;
  o.max_connections = 3;
  o.max_unsent_bytes = 64 << 10;
  o.limits.max_value_bytes = 1000;
  auto a = relay({server.endpoint}, "job", "", o);
  const int port = world(*a, 1);
  TcpStoreClient good(port, Dialect::kTorch2);
  REQUIRE(good.set("k", "v"));
  REQUIRE(good.get("k") == "v");
  {
    // A key of 2^40 bytes: closed when the length arrives, before a byte of the key.
    TcpStoreClient liar(port, Dialect::kTorch2);
    std::string frame(1, static_cast<char>(
                             muster::rendezvous::tcpstore::wire_byte(Dialect::kTorch2, Op::kGet)));
    const std::uint64_t len = 1ull << 40;
    frame.append(reinterpret_cast<const char*>(&len), sizeof len);
    REQUIRE(liar.send_raw(frame));
    CHECK(liar.closed_by_server());
  }
  {
    TcpStoreClient big(port, Dialect::kTorch2);
    REQUIRE(big.set("k", std::string(1001, 'v')));  // over this relay's value bound
    CHECK(big.closed_by_server());
  }
  {
    TcpStoreClient half(port, Dialect::kTorch2);
    const std::string frame = muster::rendezvous::tcpstore::encode(
        Dialect::kTorch2, TcpStoreClient::req(Op::kSet, {"key"}, {"value"}));
    REQUIRE(half.send_raw(frame.substr(0, 5)));
    CHECK(half.closed_by_server(5000ms));
  }
  CHECK(eventually(*a, [](const StoreRelay::Stats& s) { return s.closed_for_errors == 3; }));
  {
    // Three connections per world on this relay: a fourth is closed at once.
    TcpStoreClient second(port, Dialect::kTorch2), third(port, Dialect::kTorch2);
    REQUIRE(eventually(*a, [](const StoreRelay::Stats& s) { return s.connections == 3; }));
    TcpStoreClient fourth(port, Dialect::kTorch2);
    CHECK(fourth.closed_by_server());
    CHECK(a->stats().refused_connections == 1);
  }
  {
    // A client that asks and never reads: closed once 64 KiB of replies wait for it.
    REQUIRE(good.set("fat", std::string(1000, 'x')));
    TcpStoreClient greedy(port, Dialect::kTorch2);
    std::string asks;
    for (int i = 0; i < 20000; ++i) {
      asks += muster::rendezvous::tcpstore::encode(Dialect::kTorch2,
                                                  TcpStoreClient::req(Op::kGet, {"fat"}));
    }
    greedy.send_raw(asks);  // may fail part-way once the relay closes it
    CHECK(greedy.closed_by_server(10000ms));
  }
  CHECK(good.get("k") == "v");  // the others are served as before
}

TEST_CASE("store relay: an agent that stopped reading its workers while its stream was full "
          "reads on once the stream has taken what waited",
          "[store_relay][limits]") {
  RdzvdProc server;
  HeldRun run(server.endpoint, "job");
  StoreRelayOptions o;
  o.max_queued_up_bytes = 64 << 10;  // a few of the writes below fill it
  auto a = relay({server.endpoint}, "job", "", o);
  const int port = world(*a, 1);
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  for (int i = 0; i < 16; ++i) {
    clients.push_back(std::make_unique<TcpStoreClient>(port, Dialect::kTorch2));
    REQUIRE(clients.back()->ok());
  }
  for (int round = 0; round < 3; ++round) {
    // All at once: the agent reads them faster than one gRPC write takes them up.
    for (int i = 0; i < 16; ++i) {
      REQUIRE(clients[i]->set("k" + std::to_string(i), std::string(60 << 10, static_cast<char>('a' + round))));
    }
    for (int i = 0; i < 16; ++i) {
      INFO("round " << round << ", client " << i);
      const auto got = clients[i]->get("k" + std::to_string(i));
      REQUIRE(got.has_value());
      CHECK(*got == std::string(60 << 10, static_cast<char>('a' + round)));
    }
  }
  CHECK(a->stats().streams == 1);  // read on in the same stream, not after a new one
  CHECK(a->stats().closed_for_errors == 0);
}

TEST_CASE("store relay: rdzvd --state_dir restarted on its port: the keys are written again, a "
          "parked WAIT answered",
          "[store_relay]") {
  TempDir state;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  auto start = [&] {
    auto p = std::make_unique<Proc>(
        std::vector<std::string>{kRdzvd, "--listen", ep, "--state_dir", state.path()});
    REQUIRE(p->wait_output(out_has("listening on port"), 30s));
    return p;
  };
  auto rdzvd = start();
  HeldRun held(ep, "job");
  auto a = relay({ep}, "job");
  const int port = world(*a, held.assignment().round());
  TcpStoreClient writer(port, Dialect::kTorch2), waiter(port, Dialect::kTorch1);
  REQUIRE(writer.set("addr/0", "10.0.0.1"));
  REQUIRE(waiter.send(TcpStoreClient::req(Op::kWait, {"go"})));
  REQUIRE(writer.get("addr/0") == "10.0.0.1");
  ::kill(rdzvd->pid(), SIGKILL);
  rdzvd->wait(30s);
  rdzvd = start();  // restores the run from --state_dir, with an empty table
  CHECK(eventually(*a, [](const StoreRelay::Stats& s) { return s.replayed_writes == 1; }));
  CHECK(writer.get("addr/0") == "10.0.0.1");
  REQUIRE(writer.set("go", "1"));
  CHECK(waiter.read_u8(10s) == muster::rendezvous::tcpstore::kStopWaiting);
  ::kill(rdzvd->pid(), SIGTERM);
  CHECK(rdzvd->wait(30s) == 0);
}

namespace {

// A listener on 127.0.0.1, port 0; `at` gets its address.
int loopback_listener(sockaddr_in& at, int backlog) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  at = sockaddr_in{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0);
  REQUIRE(::listen(lfd, backlog) == 0);
  socklen_t n = sizeof at;
  REQUIRE(::getsockname(lfd, reinterpret_cast<sockaddr*>(&at), &n) == 0);
  return lfd;
}

// The accepted end of connection `cfd` to listener `lfd`, with its two addresses.
struct Accepted {
  int fd = -1;
  sockaddr_in peer{}, local{};
};

Accepted accept_from(int lfd, int cfd, const sockaddr_in& at) {
  REQUIRE(::connect(cfd, reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0);
  Accepted a;
  a.fd = ::accept(lfd, nullptr, nullptr);
  REQUIRE(a.fd >= 0);
  socklen_t n = sizeof a.peer;
  REQUIRE(::getpeername(a.fd, reinterpret_cast<sockaddr*>(&a.peer), &n) == 0);
  n = sizeof a.local;
  REQUIRE(::getsockname(a.fd, reinterpret_cast<sockaddr*>(&a.local), &n) == 0);
  return a;
}

}  // namespace

TEST_CASE("store relay: who owns a loopback connection, from sock_diag and from /proc/net/tcp",
          "[store_relay]") {
  sockaddr_in at{};
  const int lfd = loopback_listener(at, 1);
  const int cfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const Accepted a = accept_from(lfd, cfd, at);
  muster::rendezvous::PeerUid who;
  CHECK(who.owner(a.peer, a.local).value() == ::geteuid());
  CHECK(muster::rendezvous::PeerUid::owner_in_proc(a.peer, a.local).value() == ::geteuid());
  sockaddr_in nobody = a.peer;
  nobody.sin_port = 0;  // no such socket
  CHECK_FALSE(muster::rendezvous::PeerUid::owner_in_proc(nobody, a.local).ok());
  for (int fd : {a.fd, cfd, lfd}) ::close(fd);
}

TEST_CASE("store relay: the owners of a burst of connections are asked of the kernel at once, "
          "each answered in its place",
          "[store_relay]") {
  sockaddr_in at{};
  const int lfd = loopback_listener(at, 128);
  // Root makes every third socket as nobody (a socket's owner is its maker's fs uid).
  const bool root = ::geteuid() == 0;
  const uid_t nobody = 65534;
  std::vector<int> fds{lfd};
  std::vector<std::pair<sockaddr_in, sockaddr_in>> conns;
  std::vector<uid_t> want;
  for (int i = 0; i < 70; ++i) {  // past PeerUid::kMaxBatch too
    const bool other = root && i % 3 == 1;
    if (other) ::setfsuid(nobody);
    const int cfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (other) ::setfsuid(::geteuid());
    const Accepted a = accept_from(lfd, cfd, at);
    fds.push_back(cfd);
    fds.push_back(a.fd);
    conns.emplace_back(a.peer, a.local);
    want.push_back(other ? nobody : ::geteuid());
  }
  muster::rendezvous::PeerUid who;
  for (const std::size_t size : {std::size_t{2}, std::size_t{7}, muster::rendezvous::PeerUid::kMaxBatch}) {
    std::vector<std::pair<sockaddr_in, sockaddr_in>> ask(conns.begin(), conns.begin() + size);
    ask[1].first.sin_port = 0;  // no such socket: that one alone is not found
    const auto got = who.owners(ask);
    REQUIRE(got.size() == size);
    for (std::size_t i = 0; i < size; ++i) {
      INFO("batch of " << size << ", connection " << i);
      if (i == 1) {
        CHECK(absl::IsNotFound(got[i].status()));
      } else {
        REQUIRE(got[i].ok());
        CHECK(*got[i] == want[i]);
      }
    }
  }
  const auto all = who.owners(conns);  // more than one message takes: each asked alone
  REQUIRE(all.size() == conns.size());
  for (std::size_t i = 0; i < conns.size(); ++i) CHECK(all[i].value() == want[i]);
  CHECK(who.owner(conns[0].first, conns[0].second).value() == want[0]);  // nothing left over
  for (int fd : fds) ::close(fd);
}
