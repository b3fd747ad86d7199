#include "rdzvd_replica.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "muster/rendezvous/resolve.h"

namespace muster::rdzvd {

namespace {

[[noreturn]] void exit_now(const std::string& line) {
  std::fprintf(stderr, "rdzvd: error: %s\n", line.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

long long ms(std::chrono::steady_clock::duration d) {
  return static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

}  // namespace

ReplicaRole::ReplicaRole(std::unique_ptr<rendezvous::EtcdReplica> replica, std::string prefix)
    : replica_(std::move(replica)), prefix_(std::move(prefix)) {}

absl::StatusOr<std::unique_ptr<ReplicaRole>> ReplicaRole::connect(
    const rendezvous::EtcdOptions& etcd, rendezvous::ServerOptions& server) {
  auto replica = rendezvous::EtcdReplica::connect(etcd, [](const std::string& why) {
    exit_now(absl::StrCat("no longer fit to lead: ", why, "; exiting"));
  });
  if (!replica.ok()) return replica.status();
  server.standby = true;
  server.standby_hold = (*replica)->lease_ttl() + rendezvous::limits::kStandbyHoldMargin;
  server.on_store_lost = [](const absl::Status& st) {
    exit_now(absl::StrCat(st.message(), "; exiting"));
  };
  return std::unique_ptr<ReplicaRole>(new ReplicaRole(std::move(*replica), etcd.prefix));
}

ReplicaRole::~ReplicaRole() {
  if (campaigner_.joinable()) {
    resign();  // ends a campaign still waiting (a no-op when done already)
    campaigner_.join();
  }
}

void ReplicaRole::start(rendezvous::RendezvousServer& server, std::string name) {
  if (name.empty()) {
    name = absl::StrCat(rendezvous::fully_qualified_hostname(), ":", server.port());
  }
  std::printf("rdzvd: standby in etcd group %s (lease %lld ms), campaigning to lead as %s\n",
              prefix_.c_str(), static_cast<long long>(replica_->lease_ttl().count()),
              name.c_str());
  std::fflush(stdout);
  rendezvous::RendezvousServer* srv = &server;
  replica_->observe([srv, name](const std::string& leader) {
    if (leader == name) return;
    std::printf("rdzvd: %s leads\n", leader.c_str());
    std::fflush(stdout);
    srv->set_leader(leader);
  });
  campaigner_ = std::thread([srv, r = replica_.get(), name] {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = r->campaign(name);
    if (absl::IsCancelled(st)) return;  // stopping
    if (!st.ok()) exit_now(std::string(st.message()));
    const auto won = std::chrono::steady_clock::now();
    srv->lead(r->run_store(), [t0, won](const rendezvous::RestoreSummary& s) {
      for (const std::string& line : s.skipped) {
        std::printf("rdzvd: etcd: skipped %s\n", line.c_str());
      }
      std::printf("rdzvd: leading after %lld ms of standby; restored %d runs from etcd in %lld "
                  "ms (%d running, their places held for re-attach)\n",
                  ms(won - t0), s.runs, ms(std::chrono::steady_clock::now() - won), s.running);
      std::fflush(stdout);
    });
  });
}

void ReplicaRole::resign() {
  if (resigned_) return;
  resigned_ = true;
  replica_->resign();
}

}  // namespace muster::rdzvd
