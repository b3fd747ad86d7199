#include "state/etcd/etcd_client.h"

#include <condition_variable>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "muster/rendezvous/resolve.h"

namespace muster::rendezvous::etcd {

absl::StatusOr<std::shared_ptr<Stubs>> connect(const std::string& endpoints) {
  std::vector<std::string> v4, v6, each;
  for (absl::string_view e : absl::StrSplit(endpoints, ',', absl::SkipWhitespace())) {
    std::string one(absl::StripAsciiWhitespace(e));
    if (one.starts_with("http://")) one = one.substr(7);
    const auto colon = one.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(one.substr(colon + 1), &port) ||
        port <= 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("--etcd: '", one, "' is not HOST:PORT (etcd's client port)"));
    }
    std::string host = one.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    absl::StatusOr<std::vector<std::string>> addrs = resolve_host(host);
    if (!addrs.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--etcd: ", addrs.status().message()));
    }
    const std::string& a = addrs->front();
    if (a.find(':') == std::string::npos) {
      v4.push_back(absl::StrCat(a, ":", port));
      each.push_back(absl::StrCat("ipv4:", v4.back()));
    } else {
      v6.push_back(absl::StrCat("[", a, "]:", port));
      each.push_back(absl::StrCat("ipv6:", v6.back()));
    }
  }
  if (v4.empty() && v6.empty()) return absl::InvalidArgumentError("--etcd: no endpoint given");
  if (!v4.empty() && !v6.empty()) {
    return absl::InvalidArgumentError("--etcd: give every member in one address family");
  }
  const std::string target =
      v4.empty() ? absl::StrCat("ipv6:", absl::StrJoin(v6, ",")) : absl::StrCat("ipv4:", absl::StrJoin(v4, ","));
  grpc::ChannelArguments args;
  args.SetLoadBalancingPolicyName("round_robin");
  // A member back after a restart is used again within a second, not after gRPC's default
  // backoff of up to two minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  // A member whose connection went silent (a partition: no FIN, no RST) is found by a ping
  // within limits::kEtcdKeepAlive plus one second and reconnected afresh, rather than kept
  // READY with its TCP stuck in retransmission back-off long after the path is back (calls
  // round-robined to it would each cost an attempt). Not more often: etcd refuses pings
  // closer than 5 s (--grpc-keepalive-min-time).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(limits::kEtcdKeepAlive.count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A round of many nodes is read back in pages; a page may still be large.
  args.SetMaxReceiveMessageSize(64 << 20);
  auto s = std::make_shared<Stubs>();
  s->endpoints = endpoints;
  s->channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  s->kv = etcdserverpb::KV::NewStub(s->channel);
  s->lease = etcdserverpb::Lease::NewStub(s->channel);
  s->election = v3electionpb::Election::NewStub(s->channel);
  for (const std::string& one : each) {
    s->members.push_back(etcdserverpb::Maintenance::NewStub(
        grpc::CreateCustomChannel(one, grpc::InsecureChannelCredentials(), args)));
  }
  return s;
}

int reachable_members(const Stubs& s, std::chrono::milliseconds bound) {
  struct Call {
    grpc::ClientContext ctx;
    etcdserverpb::StatusRequest req;
    etcdserverpb::StatusResponse resp;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::mutex mu;
  std::condition_variable cv;
  std::size_t done = 0;
  int ok = 0;
  const auto deadline = std::chrono::system_clock::now() + bound;
  for (const auto& member : s.members) {
    calls.push_back(std::make_unique<Call>());
    Call* c = calls.back().get();
    c->ctx.set_deadline(deadline);
    member->async()->Status(&c->ctx, &c->req, &c->resp, [&](grpc::Status st) {
      std::lock_guard<std::mutex> lock(mu);
      ok += st.ok();
      ++done;
      cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done == calls.size(); });
  return ok;
}

absl::Status error(const Stubs& s, const char* what, const grpc::Status& st) {
  return absl::UnavailableError(absl::StrCat("etcd at ", s.endpoints, ": ", what, ": ",
                                             st.error_message(), " (code ",
                                             static_cast<int>(st.error_code()), ")"));
}

}  // namespace muster::rendezvous::etcd
