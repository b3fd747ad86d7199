// A replica's lease, its campaign and what it sees of the others (etcd.h).
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "state/etcd/etcd_client.h"
#include "muster/rendezvous/etcd.h"

namespace muster::rendezvous {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class EtcdReplica::Impl {
 public:
  EtcdOptions opts;
  std::function<void(const std::string&)> on_lost;
  std::shared_ptr<etcd::Stubs> stubs;
  std::int64_t lease = 0;  // written by the keeper thread only, under mu (lapse)
  milliseconds ttl{0};

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;           // under mu
  bool lost = false;               // under mu
  bool leading = false;            // under mu: campaign() won with the lease held now
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

  // Grants a lease (one call, retried within request_timeout): its id and TTL.
  absl::StatusOr<std::pair<std::int64_t, milliseconds>> grant() {
    etcdserverpb::LeaseGrantRequest req;
    req.set_ttl(std::max<std::int64_t>(1, (opts.lease_ttl.count() + 999) / 1000));  // whole s
    etcdserverpb::LeaseGrantResponse resp;
    grpc::Status st = etcd::call_with_retry(
        std::chrono::system_clock::now() + opts.request_timeout, stubs->attempt,
        [&](grpc::ClientContext& ctx) { return stubs->lease->LeaseGrant(&ctx, req, &resp); });
    if (!st.ok()) return etcd::error(*stubs, "granting a lease", st);
    if (!resp.error().empty()) {
      return absl::UnavailableError(
          absl::StrCat("etcd at ", opts.endpoints, ": granting a lease: ", resp.error()));
    }
    return std::make_pair(resp.id(), milliseconds(resp.ttl() * 1000));
  }

  // The lease is gone, or may be. A leader must stop (lose). A standby decides nothing and
  // wrote nothing under it: it takes a new lease and campaigns on with it (its campaign is
  // asked again), rather than leaving the group one replica short. False when it stops.
  bool lapse(const std::string& why) {
    bool is_leading;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping || lost) return false;
      is_leading = leading;
    }
    if (is_leading) {
      lose(absl::StrCat("its ", why));
      return false;
    }
    spdlog::warn("rdzvd: the standby's {}; it takes a new lease and campaigns on", why);
    for (;;) {
      absl::StatusOr<std::pair<std::int64_t, milliseconds>> fresh = grant();
      std::unique_lock<std::mutex> lock(mu);
      if (stopping || lost) return false;
      if (leading) {  // its campaign won under the old lease meanwhile: a leader now
        lock.unlock();
        if (fresh.ok()) revoke(fresh->first, limits::kEtcdMinAttempt);
        lose(absl::StrCat("its ", why));
        return false;
      }
      if (fresh.ok()) {
        const std::int64_t old = lease;
        lease = fresh->first;
        if (campaign_ctx != nullptr) campaign_ctx->TryCancel();  // asked again, with it
        lock.unlock();
        revoke(old, limits::kEtcdMinAttempt);  // best effort: its key goes now, not at expiry
        spdlog::info("rdzvd: etcd granted the standby lease {:x}", fresh->first);
        return true;
      }
      if (cv.wait_for(lock, ttl / 4, [&] { return stopping || lost; })) return false;
    }
  }

  void revoke(std::int64_t id, milliseconds bound) {
    etcdserverpb::LeaseRevokeRequest req;
    req.set_id(id);
    etcdserverpb::LeaseRevokeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + bound);
    (void)stubs->lease->LeaseRevoke(&ctx, req, &resp);
  }

  // One keep-alive: a short stream, one request, one answer, within `bound`. The TTL etcd
  // answers; 0 when the lease is gone; an error when etcd could not be asked.
  absl::StatusOr<std::int64_t> renew_once(milliseconds bound) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + bound);
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

  // Renews until `until`, one attempt after the other (each on the next member the channel
  // picks, each bounded by a quarter of a lease at most): a silent member costs one attempt.
  absl::StatusOr<std::int64_t> renew(Clock::time_point until) {
    const milliseconds each = std::max(limits::kEtcdMinAttempt,
                                       ttl / (2 * limits::kEtcdAttemptsPerLease));
    for (;;) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
      absl::StatusOr<std::int64_t> r = renew_once(std::max(milliseconds(1), std::min(each, left)));
      if (r.ok() || Clock::now() >= until) return r;
      std::unique_lock<std::mutex> lock(mu);
      if (cv.wait_for(lock, milliseconds(20), [&] { return stopping || lost; })) return r;
    }
  }

  // The keep-alive thread: renews every ttl/4, each renewal tried on member after member. The
  // lease is taken for lost when etcd says it is gone, or when no renewal got through by the
  // time it may expire (the last renewal sent + ttl, less a margin) and this replica is cut
  // off from etcd (fewer than a quorum of members answer it): etcd cannot have let the lease
  // go before, so no standby can have won yet, and after it one may. A quorum that answers
  // but does not renew is etcd electing its own leader, which extends every lease when it
  // is elected: that is ridden out, up to ttl plus one request timeout.
  void keep() {
    Clock::time_point renewed = Clock::now();
    std::string last_error;
    bool riding = false;
    const milliseconds margin = ttl / limits::kEtcdStepDownMarginDivisor;
    const int quorum = static_cast<int>(stubs->members.size()) / 2 + 1;
    for (;;) {
      const Clock::time_point give_up = renewed + ttl - margin;
      {
        std::unique_lock<std::mutex> lock(mu);
        const Clock::time_point next =
            riding ? Clock::now() + ttl / 8 : std::min(Clock::now() + ttl / 4, give_up);
        if (cv.wait_until(lock, next, [&] { return stopping || lost; })) return;
      }
      const Clock::time_point sent = Clock::now();
      // While riding out an election, each renewal gets a quarter of the lease.
      const Clock::time_point until = riding ? sent + ttl / 4 : give_up;
      absl::StatusOr<std::int64_t> left =
          sent < until ? renew(until)
                       : absl::StatusOr<std::int64_t>(absl::DeadlineExceededError("no time left"));
      if (left.ok() && *left > 0) {
        if (!last_error.empty()) spdlog::info("rdzvd: etcd renews the lease again");
        renewed = sent;
        last_error.clear();
        riding = false;
        continue;
      }
      if (left.ok()) {
        if (!lapse(absl::StrFormat("lease %x expired (etcd at %s)", lease, stubs->endpoints))) {
          return;
        }
        renewed = Clock::now();
        last_error.clear();
        riding = false;
        continue;
      }
      if (last_error.empty()) spdlog::warn("rdzvd: {}", std::string(left.status().message()));
      last_error = std::string(left.status().message());
      if (Clock::now() >= give_up && Clock::now() - renewed < ttl + opts.request_timeout) {
        const int reach = etcd::reachable_members(
            *stubs, std::max(limits::kEtcdMinAttempt, ttl / (2 * limits::kEtcdAttemptsPerLease)));
        if (reach >= quorum) {
          if (!riding) {
            spdlog::warn("rdzvd: {} of {} etcd members answer but none renews the lease: etcd "
                         "is electing its leader (which extends every lease); riding it out",
                         reach, stubs->members.size());
          }
          riding = true;
          continue;
        }
        riding = false;
      }
      if (Clock::now() >= give_up) {
        if (!lapse(absl::StrCat(
                "lease could not be renewed for ",
                std::chrono::duration_cast<milliseconds>(Clock::now() - renewed).count(),
                " ms, and may expire now (lease ", ttl.count(), " ms): ", last_error))) {
          return;
        }
        renewed = Clock::now();
        last_error.clear();
        riding = false;
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
  absl::StatusOr<std::pair<std::int64_t, milliseconds>> granted = impl->grant();
  if (!granted.ok()) return granted.status();
  impl->lease = granted->first;
  impl->ttl = granted->second;
  impl->stubs->attempt =
      std::max(limits::kEtcdMinAttempt, impl->ttl / limits::kEtcdAttemptsPerLease);
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
  req.set_value(name);
  v3electionpb::CampaignResponse resp;
  for (;;) {
    // A standby waits as long as another leads, one lease at a time: a member gone silent
    // under the call (its connection looks open) holds it for one lease, not for ever.
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + m.ttl);
    ctx.set_wait_for_ready(true);
    std::int64_t lease = 0;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      if (m.stopping || m.lost) return absl::CancelledError("rdzvd is stopping");
      m.campaign_ctx = &ctx;
      lease = m.lease;
    }
    req.set_lease(lease);
    grpc::Status st = m.stubs->election->Campaign(&ctx, req, &resp);
    std::unique_lock<std::mutex> lock(m.mu);
    m.campaign_ctx = nullptr;
    if (m.stopping || m.lost) return absl::CancelledError("rdzvd is stopping");
    if (st.ok() && lease == m.lease) {
      m.leading = true;
      break;
    }
    // A win under a lease the keeper has since given up is no win (its key goes with that
    // lease): the campaign goes on under the new one. The member that held the call went
    // away or went silent (or etcd is electing its own leader), or a lease went by with
    // another one leading: the same campaign again, on whichever member answers. It holds no
    // state but this replica's key under the lease, so asking again is safe.
    // NOT_FOUND is etcd's "requested lease not found": the lease went before the keeper saw
    // it go; the keeper takes a new one, and the next ask uses it.
    if (!st.ok() && lease == m.lease && !etcd::try_again(st) &&
        st.error_code() != grpc::StatusCode::NOT_FOUND) {
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
      ctx.set_deadline(std::chrono::system_clock::now() + m->ttl);  // then asked again
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
  {
    std::lock_guard<std::mutex> lock(m.mu);
    req.set_id(m.lease);
  }
  etcdserverpb::LeaseRevokeResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + m.opts.request_timeout);
  grpc::Status st = m.stubs->lease->LeaseRevoke(&ctx, req, &resp);
  if (!st.ok()) spdlog::warn("rdzvd: {}", std::string(etcd::error(*m.stubs, "revoking the lease", st).message()));
}

}  // namespace muster::rendezvous
