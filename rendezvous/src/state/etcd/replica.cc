// A replica's lease, its campaign and what it sees of the others (etcd.h).
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "state/etcd/client.h"
#include "muster/rendezvous/etcd.h"

namespace muster::rendezvous {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class EtcdReplica::Impl {
 public:
  EtcdOptions opts;
  std::function<void(const std::string&)> on_lost;
  std::shared_ptr<etcd::Stubs> stubs;
  std::int64_t lease = 0;
  milliseconds ttl{0};

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;           // under mu
  bool lost = false;               // under mu
  grpc::ClientContext* campaign_ctx = nullptr;  // under mu, while campaign() waits
  grpc::ClientContext* observe_ctx = nullptr;   // under mu, while observing
  std::thread keeper, observer;
  std::shared_ptr<RunStore> store;

  std::string election_name() const { return absl::StrCat(opts.prefix, "leader"); }

  void lose(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (lost || stopping) return;
      lost = true;
      if (campaign_ctx != nullptr) campaign_ctx->TryCancel();
    }
    on_lost(why);
  }

  // One keep-alive: a short stream, one request, one answer. The TTL etcd answers; 0 when the
  // lease is gone; an error when etcd could not be asked.
  absl::StatusOr<std::int64_t> renew() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + ttl / 2);
    auto stream = stubs->lease->LeaseKeepAlive(&ctx);
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseKeepAliveResponse resp;
    if (!stream->Write(req) || !stream->Read(&resp)) {
      stream->WritesDone();
      return etcd::error(*stubs, "renewing the lease", stream->Finish());
    }
    stream->WritesDone();
    (void)stream->Finish();
    return resp.ttl();
  }

  // The keep-alive thread: renews every ttl/4. The lease is taken for lost when etcd says it
  // is gone, or when no renewal got through for ttl plus one request timeout: etcd's new
  // leader among its members renews every lease on election (so an etcd election is ridden
  // out), and by then another replica may lead.
  void keep() {
    Clock::time_point renewed = Clock::now();
    std::string last_error;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu);
        if (cv.wait_for(lock, ttl / 4, [&] { return stopping || lost; })) return;
      }
      const Clock::time_point sent = Clock::now();
      absl::StatusOr<std::int64_t> left = renew();
      if (left.ok() && *left > 0) {
        renewed = sent;
        last_error.clear();
        continue;
      }
      if (left.ok()) {
        lose(absl::StrFormat("its lease %x expired (etcd at %s)", lease, stubs->endpoints));
        return;
      }
      if (last_error.empty()) spdlog::warn("rdzvd: {}", std::string(left.status().message()));
      last_error = std::string(left.status().message());
      if (Clock::now() - renewed > ttl + opts.request_timeout) {
        lose(absl::StrCat("its lease could not be renewed for ",
                          std::chrono::duration_cast<milliseconds>(Clock::now() - renewed).count(),
                          " ms: ", last_error));
        return;
      }
    }
  }
};

absl::StatusOr<std::unique_ptr<EtcdReplica>> EtcdReplica::connect(
    EtcdOptions options, std::function<void(const std::string&)> on_lost) {
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(options);
  impl->on_lost = std::move(on_lost);
  absl::StatusOr<std::shared_ptr<etcd::Stubs>> stubs = etcd::connect(impl->opts.endpoints);
  if (!stubs.ok()) return stubs.status();
  impl->stubs = std::move(*stubs);
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(std::max<std::int64_t>(
      1, (impl->opts.lease_ttl.count() + 999) / 1000));  // etcd's TTLs are whole seconds
  etcdserverpb::LeaseGrantResponse resp;
  grpc::Status st = etcd::call_with_retry(
      std::chrono::system_clock::now() + impl->opts.request_timeout,
      [&](grpc::ClientContext& ctx) { return impl->stubs->lease->LeaseGrant(&ctx, req, &resp); });
  if (!st.ok()) return etcd::error(*impl->stubs, "granting a lease", st);
  if (!resp.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd at ", impl->opts.endpoints,
                                               ": granting a lease: ", resp.error()));
  }
  impl->lease = resp.id();
  impl->ttl = milliseconds(resp.ttl() * 1000);
  Impl* raw = impl.get();
  impl->keeper = std::thread([raw] { raw->keep(); });
  return std::unique_ptr<EtcdReplica>(new EtcdReplica(std::move(impl)));
}

EtcdReplica::EtcdReplica(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

EtcdReplica::~EtcdReplica() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
    if (impl_->campaign_ctx != nullptr) impl_->campaign_ctx->TryCancel();
    if (impl_->observe_ctx != nullptr) impl_->observe_ctx->TryCancel();
  }
  impl_->cv.notify_all();
  if (impl_->keeper.joinable()) impl_->keeper.join();
  if (impl_->observer.joinable()) impl_->observer.join();
}

std::chrono::milliseconds EtcdReplica::lease_ttl() const { return impl_->ttl; }

absl::Status EtcdReplica::campaign(const std::string& name) {
  Impl& m = *impl_;
  v3electionpb::CampaignRequest req;
  req.set_name(m.election_name());
  req.set_lease(m.lease);
  req.set_value(name);
  v3electionpb::CampaignResponse resp;
  for (;;) {
    grpc::ClientContext ctx;  // no deadline: a standby waits as long as another leads
    ctx.set_wait_for_ready(true);
    {
      std::lock_guard<std::mutex> lock(m.mu);
      if (m.stopping || m.lost) return absl::CancelledError("rdzvd is stopping");
      m.campaign_ctx = &ctx;
    }
    grpc::Status st = m.stubs->election->Campaign(&ctx, req, &resp);
    std::unique_lock<std::mutex> lock(m.mu);
    m.campaign_ctx = nullptr;
    if (m.stopping || m.lost) return absl::CancelledError("rdzvd is stopping");
    if (st.ok()) break;
    // The member that held the call went away (or etcd is electing its own leader): the
    // same campaign again on another one. It holds no state but this replica's key, which
    // etcd keeps under the lease, so asking again is safe; only the lease's end stops it.
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) {
      return etcd::error(*m.stubs, "campaigning to lead", st);
    }
    if (m.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return m.stopping || m.lost; })) {
      return absl::CancelledError("rdzvd is stopping");
    }
  }
  m.store = etcd::make_run_store(m.stubs, m.opts.prefix, m.opts.request_timeout,
                                 resp.leader().key(), resp.leader().rev());
  return absl::OkStatus();
}

void EtcdReplica::observe(std::function<void(const std::string&)> on_leader) {
  Impl* m = impl_.get();
  m->observer = std::thread([m, on_leader = std::move(on_leader)] {
    std::string last;
    for (;;) {
      grpc::ClientContext ctx;
      {
        std::lock_guard<std::mutex> lock(m->mu);
        if (m->stopping) return;
        m->observe_ctx = &ctx;
      }
      v3electionpb::LeaderRequest req;
      req.set_name(m->election_name());
      auto stream = m->stubs->election->Observe(&ctx, req);
      v3electionpb::LeaderResponse resp;
      while (stream->Read(&resp)) {
        if (resp.kv().value() != last) {
          last = resp.kv().value();
          on_leader(last);
        }
      }
      (void)stream->Finish();
      std::unique_lock<std::mutex> lock(m->mu);
      m->observe_ctx = nullptr;
      // The member went away or there is no leader yet: ask again shortly.
      if (m->cv.wait_for(lock, std::chrono::milliseconds(100), [m] { return m->stopping; })) {
        return;
      }
    }
  });
}

std::shared_ptr<RunStore> EtcdReplica::run_store() { return impl_->store; }

void EtcdReplica::resign() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stopping = true;
    if (m.campaign_ctx != nullptr) m.campaign_ctx->TryCancel();
  }
  m.cv.notify_all();
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(m.lease);
  etcdserverpb::LeaseRevokeResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + m.opts.request_timeout);
  grpc::Status st = m.stubs->lease->LeaseRevoke(&ctx, req, &resp);
  if (!st.ok()) spdlog::warn("rdzvd: {}", std::string(etcd::error(*m.stubs, "revoking the lease", st).message()));
}

}  // namespace muster::rendezvous
