// What the store relay's integration tests share: a relay of a run on given servers, a
// world's port, waiting for its counters, an rdzvd a test kills -9.
#pragma once

#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "held_run.h"
#include "helpers.h"
#include "muster/rendezvous/store_relay.h"
#include "rdzvd_proc.h"
#include "tcpstore_client.h"

namespace muster::testing {

using namespace std::chrono_literals;

inline std::unique_ptr<rendezvous::StoreRelay> relay(std::vector<std::string> targets,
                                                     const std::string& run,
                                                     const std::string& token = "",
                                                     rendezvous::StoreRelayOptions o = {}) {
  o.targets = std::move(targets);
  o.run_id = run;
  o.token = token;
  auto r = rendezvous::StoreRelay::start(o);
  REQUIRE(r.ok());
  return std::move(*r);
}

inline int world(rendezvous::StoreRelay& r, int round) {
  auto p = r.world(round);
  REQUIRE(p.ok());
  return *p;
}

// Until `pred(stats)` holds (the relay's counters move on its own thread).
template <class P>
bool eventually(const rendezvous::StoreRelay& r, P pred) {
  const auto end = std::chrono::steady_clock::now() + 10s;
  while (!pred(r.stats())) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

inline bool wait_for(TcpStoreClient& c, const std::string& key) {
  if (!c.send(TcpStoreClient::req(rendezvous::tcpstore::Op::kWait, {key}))) return false;
  return c.read_u8(10s) == muster::rendezvous::tcpstore::kStopWaiting;
}

// An rdzvd this test kills -9 (RdzvdProc expects a clean end).
struct KilledRdzvd {
  std::unique_ptr<Proc> proc;
  std::string endpoint;
  KilledRdzvd() {
    proc = std::make_unique<Proc>(std::vector<std::string>{kRdzvd, "--listen", "127.0.0.1:0"});
    REQUIRE(proc->wait_output(
        [](const std::string& out, const std::string&) {
          const auto at = out.find("listening on port");
          return at != std::string::npos && out.find('\n', at) != std::string::npos;
        },
        30s));
    std::smatch m;
    const std::string out = proc->out();
    REQUIRE(std::regex_search(out, m, std::regex(R"(listening on port (\d+))")));
    endpoint = "127.0.0.1:" + m[1].str();
  }
  void kill9() {
    ::kill(proc->pid(), SIGKILL);
    proc->wait(30s);
  }
};

// A server holding run "job", and two nodes' agents of it.
struct TwoAgents {
  RdzvdProc server;
  HeldRun run{server.endpoint, "job"};
  std::unique_ptr<rendezvous::StoreRelay> a = relay({server.endpoint}, "job");
  std::unique_ptr<rendezvous::StoreRelay> b = relay({server.endpoint}, "job");
};

// TwoAgents whose agent a keeps its stream while a test holds the server stopped (SIGSTOP) to
// make queries meet: on a loaded machine the hold can outlast the keep-alive's 2 s, and the
// stream's loss is not what such a test is about.
inline rendezvous::StoreRelayOptions patient() {
  rendezvous::StoreRelayOptions o;
  o.keep_alive_interval = std::chrono::minutes(1);
  o.keep_alive_timeout = std::chrono::minutes(1);
  return o;
}
struct TwoAgentsPatient {
  RdzvdProc server;
  HeldRun run{server.endpoint, "job"};
  std::unique_ptr<rendezvous::StoreRelay> a = relay({server.endpoint}, "job", "", patient());
  std::unique_ptr<rendezvous::StoreRelay> b = relay({server.endpoint}, "job");
};

// Two servers holding run "job", the first to be killed -9, and an agent that knows both
// (its stream goes to the second once the first is lost); `port`: its listener of round 1.
struct TwoServers {
  KilledRdzvd first;
  RdzvdProc second;
  HeldRun on_first{first.endpoint, "job"};
  HeldRun on_second{second.endpoint, "job"};
  std::unique_ptr<rendezvous::StoreRelay> a = relay({first.endpoint, second.endpoint}, "job");
  int port = world(*a, 1);
};

}  // namespace muster::testing
