// Simulated agents for the store benchmarks (bench/run tcpstore, store_scale): holds run RUN on
// the rendezvous server at ENDPOINT (a one-node round, as tests/support/held_run.h), starts N
// StoreRelays of that run (one agent's each; with N > 1 they share one thread, as simulated
// agents of one process) and opens the round's world on each. Prints "ports P1,P2,..." once
// listening, then serves until SIGTERM or SIGINT. With ROUND, the run is not held: another
// relay_serve holds it (one process may hold only so many descriptors), this one serves round
// ROUND's world of it. --no-cache: the relays answer no read from what their node set (every
// read goes to rdzvd, as a read of a key another node set does). --no-combine: each ADD and
// WAIT of a worker goes to rdzvd as it came (none combined with the node's others).
// --write-behind=US,MAX_US: the relays' write-behind (StoreRelayOptions), for studies of it.
//   relay_serve [--no-cache] [--no-combine] [--write-behind=US,MAX_US] ENDPOINT RUN [N [ROUND]]
#include <signal.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "../tests/support/held_run.h"
#include "absl/synchronization/mutex.h"
#include "muster/rendezvous/store_relay.h"

int main(int argc, char** argv) {
  bool cache = true, combine = true;
  std::chrono::microseconds behind = muster::rendezvous::limits::kRelayWriteBehind;
  std::chrono::microseconds behind_max = muster::rendezvous::limits::kRelayWriteBehindMax;
  for (; argc > 1 && std::string(argv[1]).rfind("--", 0) == 0; --argc, ++argv) {
    const std::string flag = argv[1];
    if (flag == "--no-cache") {
      cache = false;
    } else if (flag == "--no-combine") {
      combine = false;
    } else if (flag.rfind("--write-behind=", 0) == 0) {
      const std::string v = flag.substr(flag.find('=') + 1);
      const auto comma = v.find(',');
      if (comma == std::string::npos) {
        std::fprintf(stderr, "relay_serve: --write-behind=US,MAX_US\n");
        return 2;
      }
      behind = std::chrono::microseconds(std::atoll(v.substr(0, comma).c_str()));
      behind_max = std::chrono::microseconds(std::atoll(v.substr(comma + 1).c_str()));
    } else {
      std::fprintf(stderr, "relay_serve: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: relay_serve [--no-cache] [--no-combine] [--write-behind=US,MAX_US] "
                 "ENDPOINT RUN [N [ROUND]]\n");
    return 2;
  }
  // As launch does: Debian's abseil would check every absl::Mutex for lock-order cycles.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const std::string endpoint = argv[1], run = argv[2];
  const int n = argc > 3 ? std::atoi(argv[3]) : 1;
  rlimit nofile{};
  ::getrlimit(RLIMIT_NOFILE, &nofile);
  const rlim_t want = 200000;
  if (nofile.rlim_max < want) {
    rlimit more{want, want};
    if (::setrlimit(RLIMIT_NOFILE, &more) == 0) nofile = more;
  }
  nofile.rlim_cur = nofile.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &nofile);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // the threads inherit the mask
  spdlog::set_default_logger(spdlog::stderr_logger_mt("relay_serve"));  // stdout: the ports
  std::unique_ptr<muster::testing::HeldRun> held;
  int round = argc > 4 ? std::atoi(argv[4]) : 0;
  if (argc <= 4) {
    held = std::make_unique<muster::testing::HeldRun>(endpoint, run);
    round = held->assignment().round();
  }
  auto loop = n > 1 ? muster::rendezvous::make_store_relay_loop() : nullptr;
  std::vector<std::unique_ptr<muster::rendezvous::StoreRelay>> relays;
  std::string ports;
  for (int i = 0; i < n; ++i) {
    muster::rendezvous::StoreRelayOptions o;
    o.targets = {endpoint};
    o.run_id = run;
    o.cache = cache;
    o.combine = combine;
    o.write_behind = behind;
    o.write_behind_max = behind_max;
    auto r = muster::rendezvous::StoreRelay::start(o, loop);
    if (!r.ok()) {
      std::fprintf(stderr, "relay_serve: %s\n", std::string(r.status().message()).c_str());
      return 1;
    }
    auto port = (*r)->world(round);
    if (!port.ok()) {
      std::fprintf(stderr, "relay_serve: %s\n", std::string(port.status().message()).c_str());
      return 1;
    }
    ports += (i ? "," : "") + std::to_string(*port);
    relays.push_back(std::move(*r));
  }
  std::printf("ports %s round %d\n", ports.c_str(), round);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  // What the relays did, for the benchmark's notes.
  muster::rendezvous::StoreRelay::Stats all;
  for (const auto& r : relays) {
    const auto s = r->stats();
    all.combined_adds += s.combined_adds;
    all.adds_combined += s.adds_combined;
    all.waits_joined += s.waits_joined;
    all.reads_answered_here += s.reads_answered_here;
  }
  std::fprintf(stderr,
               "relay_serve: %llu ADDs sent for %llu of the workers', %llu WAITs joined "
               "another's, %llu reads answered here\n",
               static_cast<unsigned long long>(all.combined_adds),
               static_cast<unsigned long long>(all.adds_combined),
               static_cast<unsigned long long>(all.waits_joined),
               static_cast<unsigned long long>(all.reads_answered_here));
  return 0;
}
