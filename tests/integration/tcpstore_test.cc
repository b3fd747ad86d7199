// The TCPStore-protocol store (tcpstore_server.h): torch 1.13's own Python client against it
// (the conformance script, which torch's own server passes too), torch 2.x's queries through
// our client (support/tcpstore_client.h), and its bounds: lying and half-sent frames, the
// connection and wait limits, a client that does not read, 10,000 idle connections.
#include <sys/resource.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <memory>
#include <set>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "helpers.h"
#include "muster/rendezvous/tcpstore_server.h"
#include "tcpstore_client.h"

using namespace muster::testing;
using muster::rendezvous::StoreLimits;
using muster::rendezvous::TcpStoreOptions;
using muster::rendezvous::TcpStoreServer;
using Dialect = muster::rendezvous::tcpstore::Dialect;
using Op = muster::rendezvous::tcpstore::Op;
namespace wire = muster::rendezvous::tcpstore;

namespace {

std::unique_ptr<TcpStoreServer> serve(TcpStoreOptions o = {}) {
  auto s = TcpStoreServer::start(o);
  REQUIRE(s.ok());
  return std::move(*s);
}

const std::string kScript = std::string(INTEROP_SCRIPTS_DIR) + "/tcpstore_conformance.py";

// Until `pred(stats)` holds (the server's counters move on its own thread).
template <class P>
bool eventually(const TcpStoreServer& s, P pred) {
  const auto end = std::chrono::steady_clock::now() + 10s;
  while (!pred(s.stats())) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

}  // namespace

TEST_CASE("tcpstore: torch 1.13's own TCPStore client passes the conformance script",
          "[tcpstore][interop]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (python3-torch)");
  auto server = serve();
  Proc py({"/usr/bin/python3", kScript, "127.0.0.1", std::to_string(server->port())});
  const auto rc = py.wait(120s);
  INFO(py.out() << py.err());
  REQUIRE(rc == 0);
  CHECK_THAT(py.out(), Catch::Contains("conformance: ok"));
  // The one ADD to a non-integer closed that client's connection; nothing else did.
  CHECK(server->stats().closed_for_errors == 1);
}

TEST_CASE("tcpstore: the conformance script's expectations are those of torch's own server",
          "[tcpstore][interop]") {
  if (!torch_importable()) MUSTER_SKIP("/usr/bin/python3 cannot import torch (python3-torch)");
  Proc py({"/usr/bin/python3", kScript, "--torch"});
  const auto rc = py.wait(120s);
  INFO(py.out() << py.err());
  REQUIRE(rc == 0);
  CHECK_THAT(py.out(), Catch::Contains("conformance: ok"));
}

TEST_CASE("tcpstore: torch 2.x's handshake and queries (PING, APPEND, MULTI_*, CANCEL_WAIT)",
          "[tcpstore]") {
  auto server = serve();
  TcpStoreClient c(server->port(), Dialect::kTorch2);
  REQUIRE(c.ok());
  auto ping = TcpStoreClient::req(Op::kPing, {});
  ping.number = 0xC0FFEE;
  REQUIRE(c.send(ping));
  CHECK(c.read_value<std::uint32_t>() == 0xC0FFEEu);

  REQUIRE(c.set("a", "1"));
  CHECK(c.get("a") == "1");
  CHECK(c.get("missing") == "");  // as torch's libuv server: the client WAITs first
  REQUIRE(c.send(TcpStoreClient::req(Op::kAppend, {"a"}, {"23"})));
  REQUIRE(c.send(TcpStoreClient::req(Op::kAppend, {"fresh"}, {"x"})));
  CHECK(c.get("a") == "123");
  CHECK(c.get("fresh") == "x");
  REQUIRE(c.send(TcpStoreClient::req(Op::kMultiSet, {"m1", "m2"}, {"v1", std::string("\0v", 2)})));
  REQUIRE(c.send(TcpStoreClient::req(Op::kMultiGet, {"m2", "m1"})));
  CHECK(c.read_bytes() == std::string("\0v", 2));
  CHECK(c.read_bytes() == "v1");
  CHECK(c.check({"a", "m1"}) == true);
  CHECK(c.check({"a", "nope"}) == false);
  REQUIRE(c.send(TcpStoreClient::req(Op::kNumKeys, {})));
  CHECK(c.read_value<std::int64_t>() == 4);
  REQUIRE(c.send(TcpStoreClient::req(Op::kDelete, {"fresh"})));
  CHECK(c.read_value<std::int64_t>() == 1);
  REQUIRE(c.send(TcpStoreClient::req(Op::kDelete, {"fresh"})));
  CHECK(c.read_value<std::int64_t>() == 0);
  CHECK(c.add("count", 7) == 7);

  // WAIT parks until another client writes the last missing key, and only then answers.
  TcpStoreClient w(server->port(), Dialect::kTorch2);
  REQUIRE(w.send(TcpStoreClient::req(Op::kWait, {"a", "w1", "w2"})));
  REQUIRE(eventually(*server, [](auto s) { return s.parked_waits == 1; }));
  REQUIRE(c.set("w1", "x"));
  CHECK_FALSE(w.read_u8(200ms).has_value());  // w2 still missing
  CHECK(c.add("w2", 1) == 1);
  CHECK(w.read_u8() == wire::kStopWaiting);
  CHECK(server->stats().parked_waits == 0);

  // CANCEL_WAIT takes a parked wait out: WAIT_CANCELED, and a later write sends nothing.
  REQUIRE(w.send(TcpStoreClient::req(Op::kWait, {"later"})));
  REQUIRE(eventually(*server, [](auto s) { return s.parked_waits == 1; }));
  REQUIRE(w.send(TcpStoreClient::req(Op::kCancelWait, {})));
  CHECK(w.read_u8() == wire::kWaitCanceled);
  CHECK(server->stats().parked_waits == 0);
  REQUIRE(c.set("later", "v"));
  CHECK(c.get("later") == "v");
  CHECK_FALSE(w.read_u8(200ms).has_value());
  CHECK(w.get("later") == "v");  // and w's stream is still in step
  CHECK(server->stats().closed_for_errors == 0);
}

TEST_CASE("tcpstore: torch 2.x's queues: push, pop, len, and a WAIT on a queue", "[tcpstore]") {
  auto server = serve();
  TcpStoreClient c(server->port(), Dialect::kTorch2);
  TcpStoreClient w(server->port(), Dialect::kTorch2);
  REQUIRE(w.send(TcpStoreClient::req(Op::kWait, {"q"})));  // an empty queue is a missing key
  REQUIRE(eventually(*server, [](auto s) { return s.parked_waits == 1; }));
  REQUIRE(c.send(TcpStoreClient::req(Op::kQueuePush, {"q"}, {"one"})));
  CHECK(w.read_u8() == wire::kStopWaiting);
  REQUIRE(c.send(TcpStoreClient::req(Op::kQueuePush, {"q"}, {"two"})));
  REQUIRE(c.send(TcpStoreClient::req(Op::kQueueLen, {"q"})));
  CHECK(c.read_value<std::int64_t>() == 2);
  CHECK(c.check({"q"}) == true);
  for (const char* want : {"one", "two"}) {
    REQUIRE(c.send(TcpStoreClient::req(Op::kQueuePop, {"q"})));
    CHECK(c.read_value<std::int64_t>() > 0);
    CHECK(c.read_bytes() == want);
  }
  REQUIRE(c.send(TcpStoreClient::req(Op::kQueuePop, {"q"})));
  CHECK(c.read_value<std::int64_t>() == 0);  // empty: the count alone
  CHECK(c.check({"q"}) == false);
  REQUIRE(c.send(TcpStoreClient::req(Op::kQueueLen, {"q"})));
  CHECK(c.read_value<std::int64_t>() == 0);
}

TEST_CASE("tcpstore: torch 1.13's WATCH_KEY gets every change of its key", "[tcpstore]") {
  auto server = serve();
  TcpStoreClient c(server->port(), Dialect::kTorch1);
  TcpStoreClient watch(server->port(), Dialect::kTorch1);
  REQUIRE(watch.send(TcpStoreClient::req(Op::kWatchKey, {"k"})));
  CHECK(watch.read_u8() == wire::kWatchRegistered);
  auto event = [&](std::uint8_t kind, const std::string& old, const std::string& now) {
    INFO("event " << int(kind));
    CHECK(watch.read_u8() == kind);
    CHECK(watch.read_bytes() == "k");
    CHECK(watch.read_bytes() == old);
    CHECK(watch.read_bytes() == now);
  };
  REQUIRE(c.set("k", "1"));
  event(wire::kWatchCreated, "", "1");
  CHECK(c.add("k", 2) == 3);
  event(wire::kWatchUpdated, "1", "3");
  REQUIRE(c.send(TcpStoreClient::req(Op::kDelete, {"k"})));
  CHECK(c.read_value<std::int64_t>() == 1);
  event(wire::kWatchDeleted, "3", "");
  REQUIRE(c.set("other", "x"));
  CHECK(c.get("other") == "x");
  CHECK_FALSE(watch.read_u8(200ms).has_value());  // not its key
}

TEST_CASE("tcpstore: a frame whose length lies is refused when the length arrives",
          "[tcpstore][limits]") {
  auto server = serve();
  TcpStoreClient good(server->port(), Dialect::kTorch2);
  REQUIRE(good.set("k", "v"));
  SECTION("a key of 2^40 bytes") {
    TcpStoreClient liar(server->port(), Dialect::kTorch2);
    std::string frame(1, static_cast<char>(wire::wire_byte(Dialect::kTorch2, Op::kGet)));
    const std::uint64_t len = 1ull << 40;
    frame.append(reinterpret_cast<const char*>(&len), sizeof len);
    REQUIRE(liar.send_raw(frame));  // and not one byte of the key
    CHECK(liar.closed_by_server());
  }
  SECTION("a value over the limit, and a key count over it") {
    TcpStoreOptions o;
    o.limits.max_value_bytes = 1000;
    o.limits.max_keys_per_request = 10;
    auto small = serve(o);
    TcpStoreClient big(small->port(), Dialect::kTorch2);
    REQUIRE(big.set("k", std::string(1001, 'v')));
    CHECK(big.closed_by_server());
    TcpStoreClient many(small->port(), Dialect::kTorch2);
    std::vector<std::string> keys(11, "k");
    REQUIRE(many.send(TcpStoreClient::req(Op::kCheck, keys)));
    CHECK(many.closed_by_server());
    CHECK(small->stats().closed_for_errors == 2);
  }
  SECTION("an unknown query type") {
    TcpStoreClient odd(server->port(), Dialect::kTorch2);
    REQUIRE(odd.send_raw(std::string(1, '\x63')));
    CHECK(odd.closed_by_server());
  }
  CHECK(good.get("k") == "v");  // the others are served as before
}

TEST_CASE("tcpstore: a half-sent frame is closed after its timeout, trickling or not",
          "[tcpstore][limits]") {
  TcpStoreOptions o;
  o.partial_frame_timeout = 300ms;
  auto server = serve(o);
  TcpStoreClient half(server->port(), Dialect::kTorch2);
  TcpStoreClient idle(server->port(), Dialect::kTorch2);  // between frames: never timed out
  const std::string frame = wire::encode(Dialect::kTorch2, TcpStoreClient::req(Op::kSet, {"key"}, {"value"}));
  const auto t0 = std::chrono::steady_clock::now();
  // A byte every 100 ms: each is progress of a kind, but the frame is not done in 300 ms.
  for (std::size_t i = 0; i < 6 && !half.closed_by_server(0ms); ++i) {
    half.send_raw(frame.substr(i, 1));
    std::this_thread::sleep_for(100ms);  // the trickle is the point of this test
  }
  CHECK(half.closed_by_server(5000ms));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK(server->stats().closed_for_errors == 1);
  CHECK(idle.set("still", "here"));
  CHECK(idle.get("still") == "here");
}

TEST_CASE("tcpstore: connections and parked waits are bounded, the offender closed",
          "[tcpstore][limits]") {
  TcpStoreOptions o;
  o.max_connections = 4;
  o.max_waits = 2;
  auto server = serve(o);
  std::vector<std::unique_ptr<TcpStoreClient>> cs;
  for (int i = 0; i < 4; ++i) cs.push_back(std::make_unique<TcpStoreClient>(server->port(), Dialect::kTorch2));
  REQUIRE(eventually(*server, [](auto s) { return s.connections == 4; }));
  TcpStoreClient extra(server->port(), Dialect::kTorch2);
  CHECK(extra.closed_by_server());
  CHECK(server->stats().refused_connections == 1);
  REQUIRE(cs[0]->send(TcpStoreClient::req(Op::kWait, {"x"})));
  REQUIRE(cs[1]->send(TcpStoreClient::req(Op::kWait, {"x"})));
  REQUIRE(eventually(*server, [](auto s) { return s.parked_waits == 2; }));
  REQUIRE(cs[2]->send(TcpStoreClient::req(Op::kWait, {"x"})));
  CHECK(cs[2]->closed_by_server());
  CHECK(server->stats().closed_for_errors == 1);
  REQUIRE(cs[3]->set("x", "go"));
  CHECK(cs[0]->read_u8() == wire::kStopWaiting);
  CHECK(cs[1]->read_u8() == wire::kStopWaiting);
}

TEST_CASE("tcpstore: a client that never reads its replies is closed, the others go on",
          "[tcpstore][limits]") {
  TcpStoreOptions o;
  o.max_unsent_bytes = 4 << 20;
  auto server = serve(o);
  TcpStoreClient writer(server->port(), Dialect::kTorch2);
  REQUIRE(writer.set("big", std::string(1 << 20, 'b')));
  REQUIRE(writer.get("big")->size() == (1u << 20));  // set, before anyone asks for it
  TcpStoreClient glutton(server->port(), Dialect::kTorch2);
  int sent = 0;
  // 256 MiB of replies asked for, none read: far past the kernel's buffers and the limit.
  for (; sent < 256 && !glutton.closed_by_server(0ms); ++sent) {
    if (!glutton.send(TcpStoreClient::req(Op::kGet, {"big"}))) break;
  }
  CHECK(eventually(*server, [](auto s) { return s.closed_for_errors == 1; }));
  CHECK(glutton.closed_by_server());
  auto again = writer.get("big");
  REQUIRE(again.has_value());
  CHECK(again->size() == (1u << 20));
}

TEST_CASE("tcpstore: 10,000 idle connections are held, and a query is still answered",
          "[tcpstore][limits]") {
  constexpr int kConns = 10000;
  rlimit nofile{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &nofile) == 0);
  if (nofile.rlim_max < kConns + 200) {
    MUSTER_SKIP("RLIMIT_NOFILE's hard limit is " << nofile.rlim_max << ", under " << kConns + 200);
  }
  nofile.rlim_cur = nofile.rlim_max;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &nofile) == 0);
  // The server in a process of its own: each side needs its own 10,000 descriptors.
  Proc server({TCPSTORE_SERVE_BIN});
  REQUIRE(server.wait_output([](const std::string& out, const std::string&) {
    return out.find('\n') != std::string::npos;
  }, 30s));
  std::smatch m;
  REQUIRE(std::regex_search(server.out(), m, std::regex(R"(port (\d+))")));
  const int port = std::stoi(m[1]);
  std::vector<std::unique_ptr<TcpStoreClient>> idle;
  idle.reserve(kConns);
  for (int i = 0; i < kConns; ++i) {
    idle.push_back(std::make_unique<TcpStoreClient>(port, Dialect::kTorch2));
    REQUIRE(idle.back()->ok());
  }
  // Every one of them is served (the last connected first), and a new one too.
  CHECK(idle.back()->add("n", 1) == 1);
  CHECK(idle.front()->add("n", 1) == 2);
  TcpStoreClient late(port, Dialect::kTorch2);
  CHECK(late.add("n", 1) == 3);
  idle.clear();
  ::kill(server.pid(), SIGTERM);
  CHECK(server.wait(30s) == 0);
}

TEST_CASE("tcpstore: two runs' servers are separate tables", "[tcpstore]") {
  auto a = serve();
  auto b = serve();
  TcpStoreClient ca(a->port(), Dialect::kTorch1);
  TcpStoreClient cb(b->port(), Dialect::kTorch2);
  REQUIRE(ca.set("k", "a"));
  CHECK(ca.get("k") == "a");
  CHECK(cb.check({"k"}) == false);
  TcpStoreClient bad(a->port(), Dialect::kTorch2);
  REQUIRE(bad.send_raw(std::string(1, '\x63')));
  CHECK(bad.closed_by_server());
  CHECK(cb.add("n", 1) == 1);
  CHECK(b->stats().closed_for_errors == 0);
}
