// The in-place control channel (ops/control_channel.h, worker_runtime control.h): its wire,
// a world message's checks, and what the worker's end does with real sockets: an abort
// ends a ring call blocked on a peer that never answers, a world message is handed over,
// the agent's end closing is an error at once, and a ring's set-up gives up when told.
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <future>
#include <thread>

#include "muster/ops/control_channel.h"
#include "muster/rendezvous/memory_store.h"
#include "muster/worker/comm/tcp_communicator.h"
#include "muster/worker/control.h"

using namespace std::chrono_literals;
namespace control = muster::ops::control;
namespace worker = muster::worker;

namespace {

struct Pair {
  int agent = -1, child = -1;
  Pair() {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    agent = sv[0];
    child = sv[1];
  }
  ~Pair() {
    if (agent >= 0) ::close(agent);
  }
  void say(const std::string& m) const {
    REQUIRE(::send(agent, m.data(), m.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(m.size()));
  }
  std::string hear() const {
    char buf[control::kMaxMessageBytes];
    const ssize_t n = ::recv(agent, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
  }
};

const char kWorld[] =
    "world round=3 rank=1 world_size=2 local_rank=0 local_world_size=1 group_rank=1 "
    "group_world_size=2 restart_count=2 master_addr=10.0.0.1 master_port=29500 lost=4,5";

}  // namespace

TEST_CASE("control channel: messages round-trip and bad ones are refused") {
  control::Message m{control::kResumed, {{"round", "7"}}};
  const std::string text = control::encode(m);
  CHECK(text == "resumed round=7");
  auto back = control::parse(text);
  REQUIRE(back);
  CHECK(back->kind == "resumed");
  CHECK(back->number("round") == 7);
  CHECK_FALSE(back->number("missing"));
  CHECK(control::encode({"abort", {{"bad key", "x"}, {"round", "a b"}}}) == "abort");
  for (std::string bad : {std::string(), std::string("world round"), std::string("world =3"),
                          std::string("world round="), std::string("wo\x01rld"),
                          std::string("hello in_place=1\n"),
                          std::string(control::kMaxMessageBytes + 1, 'x')}) {
    INFO(bad);
    CHECK_FALSE(control::parse(bad));
  }
}

TEST_CASE("control channel: a world message is checked field by field") {
  auto w = worker::parse_world(kWorld);
  REQUIRE(w.ok());
  CHECK(w->round == 3);
  CHECK(w->rank == 1);
  CHECK(w->world_size == 2);
  CHECK(w->group_rank == 1);
  CHECK(w->restart_count == 2);
  CHECK(w->master_addr == "10.0.0.1");
  CHECK(w->master_port == 29500);
  CHECK(w->lost == std::vector<int>{4, 5});
  auto missing = worker::parse_world("world round=3 rank=0");
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains("world_size"));
  auto out_of_range = worker::parse_world(
      "world round=3 rank=2 world_size=2 local_rank=0 local_world_size=1 group_rank=0 "
      "group_world_size=1 restart_count=0 master_port=1");
  REQUIRE_FALSE(out_of_range.ok());
  CHECK_THAT(std::string(out_of_range.status().message()), Catch::Contains("out of its range"));
  CHECK_FALSE(worker::parse_world("abort round=3").ok());
}

TEST_CASE("control channel: hello and resumed reach the agent and a world is handed over") {
  Pair p;
  worker::ControlChannel ch(p.child);
  REQUIRE(ch.send_hello().ok());
  CHECK(p.hear() == "hello in_place=1");
  REQUIRE(ch.send_resumed(4).ok());
  CHECK(p.hear() == "resumed round=4");
  const auto before = ch.epoch();
  p.say("abort round=0");
  p.say("bogus \x01");  // ignored, with a line on stderr
  p.say(kWorld);
  auto w = ch.await_world(10s);
  REQUIRE(w.ok());
  CHECK(w->round == 3);
  CHECK(ch.epoch() == before + 2);  // the abort and the world
  CHECK(w->epoch == ch.epoch());  // nothing came after it
  auto none = ch.await_world(50ms);
  CHECK(none.status().code() == absl::StatusCode::kDeadlineExceeded);
  ::close(p.agent);
  p.agent = -1;
  auto closed = ch.await_world(10s);
  CHECK(closed.status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("control channel: an abort ends a ring call blocked on a silent peer") {
  muster::rendezvous::MemoryStore store;
  worker::TcpOptions opts;  // a 300 s call timeout: only the abort can end the call below
  auto c0 = std::async(std::launch::async, [&] { return worker::make_tcp_communicator(store, 0, 2, opts); });
  auto c1 = worker::make_tcp_communicator(store, 1, 2, opts);
  auto r0 = c0.get();
  REQUIRE(r0.ok());
  REQUIRE(c1.ok());
  Pair p;
  worker::ControlChannel ch(p.child);
  ch.watch(r0->get());
  std::vector<float> data(1024, 1.0f);
  auto call = std::async(std::launch::async, [&] {
    return (*r0)->all_reduce(data.data(), data.size(), worker::DType::kF32,
                             worker::ReduceOp::kSum);
  });
  // Rank 1 never calls: rank 0 is blocked until the abort.
  CHECK(call.wait_for(200ms) == std::future_status::timeout);
  p.say("abort round=0");
  REQUIRE(call.wait_for(10s) == std::future_status::ready);
  const absl::Status s = call.get();
  CHECK(s.code() == absl::StatusCode::kCancelled);
  CHECK_THAT(std::string(s.message()), Catch::Contains("aborted"));
  // And every later call fails at once.
  CHECK((*r0)->barrier().code() == absl::StatusCode::kCancelled);
  ch.forget(r0->get());
}

TEST_CASE("control channel: a ring's set-up waiting for a peer gives up when cancelled") {
  muster::rendezvous::MemoryStore store;
  worker::TcpOptions opts;
  std::atomic<bool> cancel{false};
  opts.cancelled = [&] { return cancel.load(); };
  auto setup = std::async(std::launch::async, [&] { return worker::make_tcp_communicator(store, 0, 2, opts); });
  CHECK(setup.wait_for(300ms) == std::future_status::timeout);  // rank 1 never comes
  cancel = true;
  REQUIRE(setup.wait_for(10s) == std::future_status::ready);
  auto r = setup.get();
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == absl::StatusCode::kCancelled);
}

TEST_CASE("control channel: a world taken after a later abort carries its own epoch, so what "
          "is built for it is known stale") {
  Pair p;
  worker::ControlChannel ch(p.child);
  p.say(kWorld);
  // The abort of the round after it comes before the program takes the world (it was busy):
  // a ring set up for this world must be cancelled, though no message comes after it.
  p.say("abort round=4");
  std::uint64_t now = 0;
  for (auto until = std::chrono::steady_clock::now() + 10s;
       (now = ch.epoch()) < 2 && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(1ms);  // the reader thread takes both; no event to wait on
  }
  REQUIRE(now == 2);
  auto w = ch.await_world(10s);
  REQUIRE(w.ok());
  CHECK(w->round == 3);
  CHECK(w->epoch == 1);
  CHECK(w->epoch != ch.epoch());
}
