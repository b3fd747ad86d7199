// The store relay (store_relay.h): the worlds' listeners and who may connect, the stream's
// life (opened, replayed on a new server, lost), and what comes down it.
#include "muster/rendezvous/store_relay.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <thread>

#include <spdlog/spdlog.h>

#include "client/store_relay_impl.h"

namespace muster::rendezvous {

using namespace relay_internal;

class StoreRelayLoop {
 public:
  StoreRelayLoop() : work_(asio::make_work_guard(io_)), thread_([this] { io_.run(); }) {}
  ~StoreRelayLoop() {
    work_.reset();
    thread_.join();
  }
  asio::io_context& io() { return io_; }

 private:
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
};

std::shared_ptr<StoreRelayLoop> make_store_relay_loop() {
  return std::make_shared<StoreRelayLoop>();
}

absl::StatusOr<int> StoreRelay::Impl::world(int round) {
  std::promise<absl::StatusOr<int>> got;
  asio::post(io_, [&] { got.set_value(open_world(round)); });
  return got.get_future().get();
}

void StoreRelay::Impl::shutdown() {
  std::promise<void> done;
  asio::post(io_, [&] {
    stopping_ = true;
    reconnect_.cancel();
    ready_timer_.cancel();
    behind_timer_.cancel();
    while (!worlds_.empty()) close_world(worlds_.begin());
    if (up_ != nullptr) std::exchange(up_, nullptr)->abandon();
    done.set_value();
  });
  done.get_future().wait();
  absl::MutexLock lock(&live_mu_);
  live_mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &live_upstreams_));
}

StoreRelay::Stats StoreRelay::Impl::stats() const {
  Stats s;
  s.connections = n_conns_.load();
  s.refused_other_user = n_other_user_.load();
  s.refused_connections = n_refused_.load();
  s.closed_for_errors = n_closed_.load();
  s.streams = n_streams_.load();
  s.gets_answered_here = n_gets_here_.load();
  s.replayed_writes = n_replayed_.load();
  s.reads_answered_here = n_reads_here_.load();
  s.combined_adds = n_combined_adds_.load();
  s.adds_combined = n_adds_combined_.load();
  s.waits_joined = n_waits_joined_.load();
  s.waits_sent = n_waits_sent_.load();
  s.adds_held = n_adds_held_.load();
  return s;
}

void StoreRelay::Impl::drained(RelayUpstream* up) {
  if (up != up_ || !ready_) return;
  for (const LocalPtr& c : std::exchange(paused_, {})) read(c);
}

void StoreRelay::Impl::on_down(RelayUpstream* up, v1::RelayDown& msg) {
  if (up != up_) return;
  for (v1::RelayFrame& f : *msg.mutable_frames()) {
    if (f.conn() == 0 && f.dropped_size() > 0) {
      auto w = worlds_.find(f.round());
      if (w == worlds_.end()) continue;
      for (const std::string& key : f.dropped()) w->second->cache.forget(key);
      continue;
    }
    if (f.conn() == 0) {
      on_ready(f.caches());
      continue;
    }
    if (auto a = adds_conns_.find(f.conn()); a != adds_conns_.end()) {
      on_adds(a->second, f);
      continue;
    }
    auto it = by_id_.find(f.conn());
    if (it == by_id_.end()) continue;  // the relay's own (a replay), or one closed since
    LocalPtr c = it->second;
    if (f.closed()) {
      ++n_closed_;
      spdlog::warn("store relay: the server closed the connection from {}: {}", name_of(c->from),
                   f.error());
      c->world->forget_all();  // a write of it may have been refused
      drop(c, false);
      continue;
    }
    bool led = false;
    for (std::uint32_t k = 0; k < f.replies() && !c->inflight.empty(); ++k) {
      c->inflight_bytes -= c->inflight.front().frame.size();
      led = led || c->inflight.front().leads;
      c->inflight.pop_front();
    }
    c->out += f.data();
    if (led) answer_followers(c, f.has_prefetched() ? &f.prefetched() : nullptr);
    if (f.has_prefetched() && c->wait_key) {
      c->stash.emplace(std::move(*c->wait_key), std::move(*f.mutable_prefetched()));
    }
    c->wait_key.reset();
    flush(c);
  }
}

void StoreRelay::Impl::on_lost(RelayUpstream* up) {
  if (up != up_ || stopping_) return;
  up_ = nullptr;
  up->abandon();
  forget_all();
  // The next target: a lost leader's standby leads next (one target: the same, restarted).
  ready_ = false;
  target_ = (target_ + 1) % opts_.targets.size();
  reconnect_.expires_after(limits::kRelayReconnectInterval);
  reconnect_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (!ec && !self->stopping_ && !self->by_id_.empty()) self->ensure_stream();
  });
}

void StoreRelay::Impl::ended(const grpc::Status& s) {
  if (stopping_ || s.error_code() == grpc::StatusCode::CANCELLED) return;
  std::string why = s.error_message().empty() ? "no reason given" : s.error_message();
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
      s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
      s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    spdlog::error("store relay: the server refused the stream: {}", why);
    n_closed_ += by_id_.size();
    for (auto& [id, c] : std::unordered_map<std::uint64_t, LocalPtr>(by_id_)) drop(c, false);
    last_end_ = std::move(why);
    return;
  }
  if (why == last_end_) return;
  spdlog::warn("store relay: the stream to the server ended ({}); the connections of this "
               "node's workers are carried to a new one",
               why);
  last_end_ = std::move(why);
}

void StoreRelay::Impl::upstream_done() {
  absl::MutexLock lock(&live_mu_);
  --live_upstreams_;
}

absl::StatusOr<int> StoreRelay::Impl::open_world(int round) {
  auto found = worlds_.find(round);
  if (found != worlds_.end()) return found->second->port;
  if (!worlds_.empty() && round < worlds_.rbegin()->first) {
    return absl::FailedPreconditionError("store relay: round " + std::to_string(round) +
                                         " is older than the worlds kept");
  }
  auto w = std::make_unique<World>(round, io_, opts_.limits.max_bytes, opts_.max_cached_bytes);
  boost::system::error_code ec;
  const tcp::endpoint ep(asio::ip::address_v4::loopback(), 0);
  w->acceptor.open(ep.protocol(), ec);
  if (!ec) w->acceptor.bind(ep, ec);
  // Accepted sockets inherit it (Linux): no setsockopt per connection.
  if (!ec) w->acceptor.set_option(tcp::no_delay(true), ec);
  if (!ec) w->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  // Non-blocking: accept() takes the rest of a burst without waiting for more.
  if (!ec) w->acceptor.non_blocking(true, ec);
  if (ec) return absl::UnavailableError("store relay: cannot listen on loopback: " + ec.message());
  w->port = w->acceptor.local_endpoint().port();
  World* raw = w.get();
  worlds_.emplace(round, std::move(w));
  accept(raw);
  if (opts_.connect_early) ensure_stream();
  while (worlds_.size() > std::max<std::size_t>(opts_.worlds_kept, 1)) {
    close_world(worlds_.begin());
  }
  return raw->port;
}

void StoreRelay::Impl::close_world(std::map<int, std::unique_ptr<World>>::iterator it) {
  World& w = *it->second;
  w.closing = true;
  boost::system::error_code ec;
  w.acceptor.close(ec);
  for (const LocalPtr& c : std::vector<LocalPtr>(w.conns.begin(), w.conns.end())) drop(c, true);
  if (w.adds_conn != 0 && up_ != nullptr) {
    v1::RelayFrame f;
    f.set_conn(w.adds_conn);
    f.set_closed(true);
    up_->send(std::move(f));
  }
  adds_conns_.erase(w.adds_conn);
  worlds_.erase(it);
}

void StoreRelay::Impl::accept(World* w) {
  // The peer's address comes with the accept (no getpeername).
  w->acceptor.async_accept(w->accepted_from, [this, self = shared_from_this(), w](
                                                 const boost::system::error_code& ec,
                                                 tcp::socket s) {
    if (ec == asio::error::operation_aborted || stopping_) return;
    if (!ec) {
      // The others that came with it, taken now (the listener does not block): their owners
      // asked of the kernel at once, their ADDs joining one combined ADD before it goes
      // (queue_launch posts it).
      std::vector<Accepted> burst;
      burst.push_back(Accepted{std::move(s), address_of(w->accepted_from)});
      boost::system::error_code more;
      while (burst.size() < kAcceptBurst) {
        tcp::socket next = w->acceptor.accept(w->accepted_from, more);
        if (more) break;
        burst.push_back(Accepted{std::move(next), address_of(w->accepted_from)});
      }
      take(w, burst);
    }
    accept(w);
  });
}

sockaddr_in StoreRelay::Impl::address_of(const tcp::endpoint& e) {
  sockaddr_in a{};
  if (e.protocol() == tcp::v4()) std::memcpy(&a, e.data(), sizeof a);
  return a;
}

void StoreRelay::Impl::take(World* w, std::vector<Accepted>& burst) {
  std::vector<bool> mine(burst.size(), true);
  if (opts_.same_user_only) {
    sockaddr_in local{};  // the listener's address: loopback, its port
    local.sin_family = AF_INET;
    local.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    local.sin_port = htons(static_cast<std::uint16_t>(w->port));
    std::vector<std::pair<sockaddr_in, sockaddr_in>> ask;
    for (const Accepted& a : burst) ask.emplace_back(a.from, local);
    const std::vector<absl::StatusOr<uid_t>> uids = peer_uid_.owners(ask);
    for (std::size_t i = 0; i < burst.size(); ++i) {
      const relay::Owner o =
          relay::owner_check(burst[i].from.sin_family == AF_INET, uids[i], euid_);
      if (o == relay::Owner::kUnknown) {
        spdlog::warn("store relay: cannot tell who owns a connection ({}): refused",
                     std::string(uids[i].status().message()));
      }
      mine[i] = o == relay::Owner::kMine;
    }
  }
  for (std::size_t i = 0; i < burst.size() && !stopping_; ++i) {
    on_accept(w, std::move(burst[i].sock), burst[i].from, mine[i]);
  }
}

std::string StoreRelay::Impl::name_of(const sockaddr_in& a) {
  if (a.sin_family != AF_INET) return "?";
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

void StoreRelay::Impl::on_accept(World* w, tcp::socket s, const sockaddr_in& remote, bool mine) {
  boost::system::error_code ec;
  if (!mine) {
    if (++n_other_user_ % 1000 == 1) {
      spdlog::warn("store relay: refused a connection from {}: its socket belongs to another "
                   "user ({} refused so far)",
                   name_of(remote), n_other_user_.load());
    }
    return;
  }
  if (w->conns.size() >= opts_.max_connections) {
    if (++n_refused_ % 1000 == 1) {
      spdlog::warn("store relay: refused a connection from {}: at the limit of {} "
                   "connections ({} refused so far)",
                   name_of(remote), opts_.max_connections, n_refused_.load());
    }
    return;
  }
  auto c = std::make_shared<Local>(std::move(s), io_, next_id_++, w);
  c->wire.prepare();
  c->from = remote;
  w->conns.insert(c);
  by_id_.emplace(c->id, c);
  ++n_conns_;
  ensure_stream();
  // A client that connects to ask (torch 2.x's VALIDATE, a rank's first ADD) has usually
  // sent it by now: read it at once, with no wait armed for it.
  on_readable(c);
}

void StoreRelay::Impl::ensure_stream() {
  if (up_ != nullptr || stopping_ || opts_.targets.empty()) return;
  if (stubs_.empty()) make_stubs();
  auto* up = new RelayUpstream(shared_from_this(), io_);
  {
    absl::MutexLock lock(&live_mu_);
    ++live_upstreams_;
  }
  up_ = up;
  ++n_streams_;
  replaying_ = 0;
  // A new server (a failover, a restart) knows nothing of what this node holds; what waited
  // behind in the stream lost is in the replay.
  forget_all();
  behind_.sent();
  up->first_.set_run_id(opts_.run_id);
  up->first_.set_token(opts_.token);
  up->first_.set_caches(opts_.cache);
  for (auto& [round, w] : worlds_) replay(*w);
  // What the stream lost had: nothing of it is open on the new one.
  const std::map<std::uint64_t, LocalPtr> conns(by_id_.begin(), by_id_.end());
  for (const auto& [id, c] : conns) c->opened = false;
  adds_conns_.clear();
  for (auto& [round, w] : worlds_) lose_adds(*w);
  for (const auto& [id, c] : conns) carry_over(c);
  for (auto& [round, w] : worlds_) {
    for (const std::string& key : w->adds.unlaunched()) queue_launch(*w, key);
  }
  up->begin(stubs_[target_].get());
  ready_timer_.expires_after(limits::kRelayReadyTimeout);
  ready_timer_.async_wait([self = shared_from_this(), up](const boost::system::error_code& ec) {
    if (ec || self->up_ != up || self->ready_) return;
    self->last_end_ = "no answer within " +
                      std::to_string(limits::kRelayReadyTimeout.count()) + " ms";
    spdlog::warn("store relay: {} gave no answer within {} ms; trying the next server",
                 self->opts_.targets[self->target_], limits::kRelayReadyTimeout.count());
    self->on_lost(up);
  });
}

void StoreRelay::Impl::make_stubs() {
  grpc::ChannelArguments args;
  // A connection of its own: never shared through gRPC's subchannel pool with another relay
  // of this process (simulated agents), whose streams would then queue behind the server's
  // limit of streams per connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(static_cast<int>(limits::kMaxRelayMessageBytes));
  args.SetMaxSendMessageSize(static_cast<int>(limits::kMaxRelayMessageBytes));
  args.SetString(GRPC_ARG_OPTIMIZATION_TARGET, "latency");
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_MINIMAL_STACK, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(opts_.keep_alive_interval.count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(opts_.keep_alive_timeout.count()));
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS,
              static_cast<int>(opts_.keep_alive_interval.count()));
  add_tls_channel_args(opts_.tls, args);
  for (const std::string& t : opts_.targets) {
    stubs_.push_back(v1::StoreRelay::NewStub(
        grpc::CreateCustomChannel(t, channel_credentials(opts_.tls), args)));
  }
}

void StoreRelay::Impl::replay(World& w) {
  if (w.log.empty()) return;
  const std::uint64_t id = next_id_++;
  bool first = true;
  v1::RelayFrame f;
  auto emit = [&] {
    f.set_conn(id);
    if (first) f.set_round(w.round);
    first = false;
    up_->send(std::move(f));
    f = v1::RelayFrame();
  };
  const std::vector<std::string> frames = w.log.frames();
  for (const std::string& one : frames) {
    if (!f.data().empty() && f.data().size() + one.size() > limits::kRelayBatchBytes) emit();
    f.mutable_data()->append(one);
  }
  emit();
  f.set_closed(true);
  emit();
  replaying_ += frames.size() - 1;
}

void StoreRelay::Impl::carry_over(const LocalPtr& c) {
  // Nothing owed, or asked on the new stream already (a WAIT handed on to it meanwhile).
  if (c->closed || c->opened || c->inflight.empty()) return;
  auto writes = [](Op op) {
    return op == Op::kAdd || op == Op::kCompareSet || op == Op::kDelete ||
           op == Op::kQueuePop || op == Op::kWatchKey;
  };
  for (const Owed& o : c->inflight) {
    if (!c->watching && !writes(o.op)) continue;
    ++n_closed_;
    spdlog::warn("store relay: closed the connection from {}: a write of it was in flight "
                 "when the stream to the server was lost",
                 name_of(c->from));
    drop(c, false);
    return;
  }
  for (auto it = c->inflight.begin(); it != c->inflight.end(); ++it) {
    const bool prefetch = std::next(it) == c->inflight.end() && c->wait_key &&
                          it->op == Op::kWait;
    up_frame(c, it->frame, prefetch ? &*c->wait_key : nullptr);
  }
}

void StoreRelay::Impl::lose_adds(World& w) {
  w.adds_conn = 0;
  const std::vector<LocalPtr> lost = w.adds.lose_flying();
  for (const LocalPtr& m : lost) {
    if (m->closed) continue;
    ++n_closed_;
    spdlog::warn("store relay: closed the connection from {}: its ADD was in flight when the "
                 "stream to the server was lost",
                 name_of(m->from));
    drop(m, false);
  }
}

void StoreRelay::Impl::on_ready(bool caches) {
  ready_ = true;
  caches_ = opts_.cache && caches;
  ready_timer_.cancel();
  n_replayed_ += std::exchange(replaying_, 0);
  last_end_.clear();
  for (const LocalPtr& c : std::exchange(paused_, {})) read(c);
}


StoreRelay::StoreRelay(std::shared_ptr<StoreRelayLoop> loop, std::shared_ptr<Impl> impl)
    : loop_(std::move(loop)), impl_(std::move(impl)) {}

StoreRelay::~StoreRelay() {
  impl_->shutdown();
  impl_.reset();
  loop_.reset();
}

absl::StatusOr<std::unique_ptr<StoreRelay>> StoreRelay::start(StoreRelayOptions options,
                                                             std::shared_ptr<StoreRelayLoop> loop) {
  if (options.targets.empty()) return absl::InvalidArgumentError("store relay: no server target");
  if (options.max_frame_bytes < 16) return absl::InvalidArgumentError("store relay: max_frame_bytes");
  if (!loop) loop = make_store_relay_loop();
  auto impl = std::make_shared<Impl>(std::move(options), loop->io());
  return std::unique_ptr<StoreRelay>(new StoreRelay(std::move(loop), std::move(impl)));
}

absl::StatusOr<int> StoreRelay::world(int round) { return impl_->world(round); }

StoreRelay::Stats StoreRelay::stats() const { return impl_->stats(); }

}  // namespace muster::rendezvous
