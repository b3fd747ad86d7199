#include "muster/rendezvous/store_relay.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <map>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <boost/asio.hpp>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/peer_uid.h"
#include "client/relay_rules.h"
#include "client/relay_upstream.h"
#include "client/replay_log.h"
#include "common/tcpstore_protocol.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {

namespace asio = boost::asio;
using asio::ip::tcp;
using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Parsed;
using tcpstore::Request;

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

namespace {

// Bytes one readable event takes from a worker's socket at most.
constexpr std::size_t kReadChunk = 64 << 10;
// Connections one readable event of a listener takes at most (the loop's other work waits):
// as many as one owner query asks about.
constexpr std::size_t kAcceptBurst = PeerUid::kMaxBatch;

struct World;

// A query the server owes a connection an answer to: its frame (a new stream asks again those
// that only read); `leads`: a WAIT other connections' WAITs ride on (Waiters).
struct Owed {
  Op op;
  std::string frame;
  bool leads = false;
};

// One worker's connection (the loop's).
struct Local : std::enable_shared_from_this<Local> {
  Local(tcp::socket s, asio::io_context& io, std::uint64_t id, World* w)
      : sock(std::move(s)), partial(io), id(id), world(w) {}
  tcp::socket sock;
  asio::steady_timer partial;
  const std::uint64_t id;
  World* const world;
  sockaddr_in from{};  // its address (sin_family 0: not known), named in logs only
  Dialect dialect = Dialect::kUnknown;
  std::string in, out, sending;
  bool reading = false, writing = false, closed = false, partial_armed = false;
  bool opened = false;     // the current stream has had its first frame (its round)
  bool watching = false;   // WATCH_KEY (torch 1.13): not carried over to a new stream
  // Its queries the server has not answered yet, in order.
  // A list: nothing allocated while none is owed (an empty deque holds 576 bytes).
  std::list<Owed> inflight;
  std::size_t inflight_bytes = 0;
  bool held = false;    // its ADD went up in a combined one: what it sent after waits
  std::string leads;    // the keys (Waiters' name) of its WAIT others ride on
  std::string follows;  // the keys of another's WAIT its own WAIT rides on
  std::size_t follow_slot = 0;  // where it is in that Waiters' followers
  std::optional<std::string> wait_key;  // its WAIT's key, when the value comes with the answer
  std::optional<std::pair<std::string, std::string>> stash;  // key, value: for the next GET
};
using LocalPtr = std::shared_ptr<Local>;

// ADDs of one key from this node's connections, combined into one ADD of their sum.
struct AddBatch {
  std::vector<std::pair<LocalPtr, std::int64_t>> members;  // in the order they came
  std::uint64_t sum = 0;                                   // wraps as the server's sum does
};
struct Adder {
  AddBatch flying;  // sent, not yet answered
  AddBatch next;    // the next one
  bool flies = false;
  bool queued = false;  // a launch is posted
};

// WAITs for the same keys: the leader's went up, the followers' ride on it. A follower knows
// its place in `followers` (Local::follow_slot): one leaving is swapped with the last.
struct Waiters {
  std::vector<std::string> keys;
  LocalPtr leader;
  std::vector<LocalPtr> followers;

  void add(const LocalPtr& c) {
    c->follow_slot = followers.size();
    followers.push_back(c);
  }
  void remove(const Local& c) {
    const std::size_t at = c.follow_slot;
    if (at >= followers.size() || followers[at].get() != &c) return;
    followers[at] = std::move(followers.back());
    followers[at]->follow_slot = at;
    followers.pop_back();
  }
};

struct World {
  World(int round, asio::io_context& io, std::size_t log_bytes, std::size_t cache_bytes)
      : round(round), acceptor(io), log(log_bytes), cache(cache_bytes) {}
  const int round;
  tcp::acceptor acceptor;
  tcp::endpoint accepted_from;  // the pending accept's peer
  int port = 0;
  std::unordered_set<LocalPtr> conns;
  tcpstore::ReplayLog log;
  bool log_warned = false;
  // What this node's workers SET in this world and nobody has written since, as far as the
  // server has said (RelayFrame.dropped): reads of these keys are answered here.
  relay::WorldCache cache;
  // Combined ADDs: per key; the relay's own connection on this stream that carries them
  // (0: none yet); the keys whose ADD went up on it, in order (its answers come in that order).
  std::unordered_map<std::string, Adder> adders;
  std::uint64_t adds_conn = 0;
  std::deque<std::string> adds_flying;
  // WAITs that others ride on, by their keys (waiters_name).
  std::unordered_map<std::string, Waiters> waits;
  bool closing = false;  // its connections are being closed: no WAIT is handed on
  void forget_all() { cache.forget_all(); }
};

}  // namespace



class StoreRelay::Impl : public RelayUpstreamSink,
                         public std::enable_shared_from_this<StoreRelay::Impl> {
 public:
  Impl(StoreRelayOptions o, asio::io_context& io)
      : opts_(std::move(o)),
        io_(io),
        frame_{opts_.limits.max_key_bytes, opts_.limits.max_value_bytes,
               opts_.limits.max_keys_per_request, opts_.max_frame_bytes},
        reconnect_(io),
        ready_timer_(io),
        behind_(opts_.write_behind, opts_.write_behind_max),
        behind_timer_(io),
        buf_(kReadChunk) {}

  // --- any thread ---------------------------------------------------------------------------

  absl::StatusOr<int> world(int round) {
    std::promise<absl::StatusOr<int>> got;
    asio::post(io_, [&] { got.set_value(open_world(round)); });
    return got.get_future().get();
  }

  void shutdown() {
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

  Stats stats() const {
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

  // --- the upstream's, handed over to the loop -----------------------------------------------

  // The stream has taken what made read() pause: the paused connections are read on.
  void drained(RelayUpstream* up) override {
    if (up != up_ || !ready_) return;
    for (const LocalPtr& c : std::exchange(paused_, {})) read(c);
  }

  void on_down(RelayUpstream* up, v1::RelayDown& msg) override {
    if (up != up_) return;
    for (v1::RelayFrame& f : *msg.mutable_frames()) {
      if (f.conn() == 0 && f.dropped_size() > 0) {
        auto w = worlds_.find(f.round());
        if (w == worlds_.end()) continue;
        for (const std::string& key : f.dropped()) w->second->cache.keep(key, nullptr, caches_);
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

  // The stream failed (its read ended): the connections wait for the next one.
  void on_lost(RelayUpstream* up) override {
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

  // Why a stream ended, in the log (once while the same reason repeats). A refusal that
  // another try cannot change (a token that does not open the run) ends the connections.
  void ended(const grpc::Status& s) override {
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

  void upstream_done() override {
    absl::MutexLock lock(&live_mu_);
    --live_upstreams_;
  }

 private:
  absl::StatusOr<int> open_world(int round) {
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

  void close_world(std::map<int, std::unique_ptr<World>>::iterator it) {
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

  void accept(World* w) {
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

  struct Accepted {
    tcp::socket sock;
    sockaddr_in from;  // sin_family 0: not an IPv4 peer
  };

  static sockaddr_in address_of(const tcp::endpoint& e) {
    sockaddr_in a{};
    if (e.protocol() == tcp::v4()) std::memcpy(&a, e.data(), sizeof a);
    return a;
  }

  // A burst of accepted connections: those of another user refused, the others served.
  void take(World* w, std::vector<Accepted>& burst) {
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
        if (burst[i].from.sin_family != AF_INET) {
          mine[i] = false;
        } else if (!uids[i].ok()) {
          spdlog::warn("store relay: cannot tell who owns a connection ({}): refused",
                       std::string(uids[i].status().message()));
          mine[i] = false;
        } else {
          mine[i] = *uids[i] == euid_;
        }
      }
    }
    for (std::size_t i = 0; i < burst.size() && !stopping_; ++i) {
      on_accept(w, std::move(burst[i].sock), burst[i].from, mine[i]);
    }
  }

  // "IP:PORT" of a worker's address (for logs).
  static std::string name_of(const sockaddr_in& a) {
    if (a.sin_family != AF_INET) return "?";
    char ip[INET_ADDRSTRLEN] = "?";
    ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
    return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
  }

  // `mine`: its socket is this process's user's (or anyone may connect).
  void on_accept(World* w, tcp::socket s, const sockaddr_in& remote, bool mine) {
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
    s.non_blocking(true, ec);
    auto c = std::make_shared<Local>(std::move(s), io_, next_id_++, w);
    c->from = remote;
    w->conns.insert(c);
    by_id_.emplace(c->id, c);
    ++n_conns_;
    ensure_stream();
    // A client that connects to ask (torch 2.x's VALIDATE, a rank's first ADD) has usually
    // sent it by now: read it at once, with no wait armed for it.
    on_readable(c);
  }

  // The stream, opened when there is none: the run and the token, then what this node's
  // workers wrote in each world, then the connections carried over from a stream lost.
  void ensure_stream() {
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
      for (auto& [key, a] : w->adders) {
        if (!a.next.members.empty() && !a.queued) queue_launch(*w, key);
      }
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

  void make_stubs() {
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

  void replay(World& w) {
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

  // A connection of the stream before goes on if what the server owes it only reads (a GET,
  // a WAIT...): those are asked again. One with a write in flight (ADD, COMPARE_SET, DELETE, a
  // queue's pop) or a WATCH_KEY is closed: nobody can say whether the write was served.
  void carry_over(const LocalPtr& c) {
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

  // The combined ADDs in flight on the stream lost: their workers' connections are closed
  // (nobody can say whether the ADD was served); those not sent yet go on the new stream.
  void lose_adds(World& w) {
    w.adds_conn = 0;
    w.adds_flying.clear();
    std::vector<LocalPtr> lost;
    for (auto it = w.adders.begin(); it != w.adders.end();) {
      Adder& a = it->second;
      if (a.flies) {
        a.flies = false;
        for (auto& [m, delta] : std::exchange(a.flying, {}).members) lost.push_back(m);
      }
      if (a.next.members.empty() && !a.queued) {
        it = w.adders.erase(it);
      } else {
        ++it;
      }
    }
    for (const LocalPtr& m : lost) {
      if (m->closed) continue;
      ++n_closed_;
      spdlog::warn("store relay: closed the connection from {}: its ADD was in flight when the "
                   "stream to the server was lost",
                   name_of(m->from));
      drop(m, false);
    }
  }

  void on_ready(bool caches) {
    ready_ = true;
    caches_ = opts_.cache && caches;
    ready_timer_.cancel();
    n_replayed_ += std::exchange(replaying_, 0);
    last_end_.clear();
    for (const LocalPtr& c : std::exchange(paused_, {})) read(c);
  }

  // --- a worker's socket ---------------------------------------------------------------------

  void read(const LocalPtr& c) {
    if (c->closed || c->reading) return;
    // Held behind its combined ADD: read on only to see it close (what it sends meanwhile
    // waits in `in`, one chunk at most; TCP holds the rest).
    if (c->held && c->in.size() >= kReadChunk) return;
    if (!ready_ || (up_ != nullptr && up_->full(opts_.max_queued_up_bytes))) {
      paused_.push_back(c);  // read on when the stream is there and takes more
      return;
    }
    c->reading = true;
    c->sock.async_wait(tcp::socket::wait_read, [this, self = shared_from_this(),
                                                c](const boost::system::error_code& ec) {
      c->reading = false;
      if (c->closed) return;
      if (ec) return drop(c, true);
      on_readable(c);
    });
  }

  void on_readable(const LocalPtr& c) {
    if (!ready_ || up_ == nullptr) return read(c);  // the stream went meanwhile: wait for it
    boost::system::error_code ec;
    const std::size_t n = c->sock.read_some(asio::buffer(buf_), ec);
    if (ec == asio::error::would_block) return read(c);
    if (ec || n == 0) return drop(c, true);
    c->in.append(buf_.data(), n);
    process(c);
    read(c);
  }

  // The whole frames c sent, as far as they can go now (not past an ADD of c's combined with
  // others: what follows it waits for its answer).
  void process(const LocalPtr& c) {
    last_query_ = std::chrono::steady_clock::now();
    std::size_t pos = 0, sent = 0;  // [sent, pos): frames parsed, not yet handed up
    bool asks = false;              // one of them has an answer to wait for
    auto hand_up = [&](std::size_t end) {
      up_frame(c, c->in.substr(sent, end - sent), nullptr, !asks);
      asks = false;
    };
    Request req;
    while (!c->closed && !c->held && pos < c->in.size()) {
      // It sends more after its WAIT: the server may answer that first (torch's own client
      // sends nothing but CANCEL_WAIT there). One that rode on another's WAIT asks for
      // itself; one that led stops leading (another asks in its place).
      if (!c->follows.empty()) ask_alone(c);
      if (!c->leads.empty()) stop_leading(*c);
      const auto r = tcpstore::parse(c->dialect, c->in.data() + pos, c->in.size() - pos, frame_,
                                     req);
      if (r.what == Parsed::kNeedMore) break;
      if (r.what == Parsed::kError) return fail(c, r.error);
      const std::size_t start = pos;
      pos += r.consumed;
      if (req.op == Op::kValidate) {  // the dialect is known: it goes with the first query up
        hand_up(start);
        sent = pos;
        continue;
      }
      if (c->stash && req.op == Op::kGet && req.keys.size() == 1 &&
          req.keys[0] == c->stash->first) {
        // torch's get(): the WAIT brought the value.
        hand_up(start);
        tcpstore::put_bytes(c->out, c->stash->second);
        c->stash.reset();
        ++n_gets_here_;
        sent = pos;
        continue;
      }
      c->stash.reset();
      if (answer_here(*c, req)) {
        hand_up(start);
        ++n_reads_here_;
        sent = pos;
        continue;
      }
      if (combines(*c, req)) {
        hand_up(start);
        req.op == Op::kAdd ? join_add(c, req) : join_wait(c, req);
        sent = pos;
        continue;
      }
      if (!note(*c, req, c->in.data() + start, r.consumed)) {
        return fail(c, "over " + std::to_string(opts_.max_unsent_bytes) +
                           " bytes of queries unanswered");
      }
      if (req.op == Op::kWait && req.keys.size() == 1) {
        hand_up(start);
        c->wait_key = req.keys[0];
        up_frame(c, c->in.substr(start, r.consumed), &req.keys[0]);
        sent = pos;
        continue;
      }
      asks = asks || tcpstore::answers(req.op) || req.op == Op::kCancelWait;
    }
    if (c->closed) return;
    hand_up(pos);
    c->in.erase(0, pos);
    if (c->in.empty() && c->in.capacity() > 4096) std::string().swap(c->in);
    arm_partial(c, pos > 0);
    flush(c);
    send_behind(false);  // after the replies: the worker reads them meanwhile
  }

  // What a query means for the relay: the log of writes, the answers owed. False: c was
  // closed (too much in flight).
  bool note(Local& c, const Request& req, const char* frame, std::size_t size) {
    World& w = *c.world;
    log_write(w, req);
    w.cache.remember(req, caches_);
    if (req.op == Op::kWatchKey) c.watching = true;
    if (req.op == Op::kCancelWait) {  // the WAIT is answered no more (the CANCEL_WAIT is)
      for (auto it = c.inflight.rbegin(); it != c.inflight.rend(); ++it) {
        if (it->op != Op::kWait) continue;
        c.inflight_bytes -= it->frame.size();
        const bool led = it->leads;
        c.inflight.erase(std::next(it).base());
        if (led) hand_on(c);
        break;
      }
      c.wait_key.reset();
    }
    if (!tcpstore::answers(req.op)) return true;
    c.inflight.push_back(Owed{req.op, std::string(frame, size)});
    c.inflight_bytes += size;
    if (req.op == Op::kWait) ++n_waits_sent_;
    if (req.op == Op::kWait && opts_.combine && c.leads.empty()) {
      // Others' WAITs for these keys may ride on it.
      auto [g, made] = w.waits.try_emplace(waiters_name(req.keys));
      if (made) {
        g->second.keys = req.keys;
        g->second.leader = c.shared_from_this();
        c.leads = g->first;
        c.inflight.back().leads = true;
      }
    }
    return c.inflight_bytes <= opts_.max_unsent_bytes;
  }

  void log_write(World& w, const Request& req) {
    w.log.note(req);
    if (!w.log.complete() && !w.log_warned) {
      w.log_warned = true;
      spdlog::warn("store relay: round {}'s writes from this node passed {} bytes; they are no "
                   "longer kept to be written again after a failover",
                   w.round, opts_.limits.max_bytes);
    }
  }

  // --- combining a node's ADDs and WAITs ------------------------------------------------------

  // Whether `req` of c rides with others': an ADD, or a WAIT for keys another connection of
  // the node waits for at the server; c waits for no answer of the server (its replies stay
  // in order).
  bool combines(const Local& c, const Request& req) const {
    if (!opts_.combine || !c.inflight.empty()) return false;
    if (req.op == Op::kAdd) return true;
    return req.op == Op::kWait && c.world->waits.count(waiters_name(req.keys)) != 0;
  }

  static std::string waiters_name(const std::vector<std::string>& keys) {
    std::string name;
    for (const std::string& k : keys) name += std::to_string(k.size()) + ":" + k;
    return name;
  }

  // c's ADD joins the next combined ADD of its key; c is held until it is answered.
  void join_add(const LocalPtr& c, const Request& req) {
    World& w = *c->world;
    w.cache.remember(req, caches_);  // written to the log when it goes up (a failover replays what went)
    c->held = true;
    ++n_adds_held_;
    Adder& a = w.adders[req.keys[0]];
    a.next.members.emplace_back(c, req.delta);
    a.next.sum += static_cast<std::uint64_t>(req.delta);
    if (!a.flies && !a.queued) queue_launch(w, req.keys[0]);
  }

  // The next combined ADD of `key` goes up once the loop has read what is ready now (the ADDs
  // that came together go together).
  void queue_launch(World& w, const std::string& key) {
    w.adders[key].queued = true;
    asio::post(io_, [this, self = shared_from_this(), round = w.round, key] {
      auto it = worlds_.find(round);
      if (it != worlds_.end()) launch(*it->second, key);
    });
  }

  void launch(World& w, const std::string& key) {
    auto it = w.adders.find(key);
    if (it == w.adders.end()) return;
    Adder& a = it->second;
    a.queued = false;
    if (a.flies || a.next.members.empty() || up_ == nullptr) return;  // a new stream sends it
    a.flying = std::exchange(a.next, {});
    a.flies = true;
    log_write(w, add_of(key, a.flying));
    send_add(w, key, a.flying);
    ++n_combined_adds_;
    n_adds_combined_ += a.flying.members.size();
  }

  static Request add_of(const std::string& key, const AddBatch& b) {
    Request add;
    add.op = Op::kAdd;
    add.keys = {key};
    add.delta = static_cast<std::int64_t>(b.sum);
    return add;
  }

  // The combined ADD `b` of `key` on w's connection for them (opened on this stream first).
  void send_add(World& w, const std::string& key, const AddBatch& b) {
    v1::RelayFrame f;
    std::string data;
    if (w.adds_conn == 0) {
      w.adds_conn = next_id_++;
      adds_conns_.emplace(w.adds_conn, w.round);
      f.set_round(w.round);
      data = validate_;
    }
    data += tcpstore::encode(Dialect::kTorch2, add_of(key, b));
    f.set_conn(w.adds_conn);
    f.set_data(std::move(data));
    up_->send(std::move(f));
    nothing_behind();
    w.adds_flying.push_back(key);
  }

  // Answers on a world's connection for combined ADDs: each member gets the sum as if the
  // batch's ADDs had been applied one after another.
  void on_adds(int round, v1::RelayFrame& f) {
    auto wi = worlds_.find(round);
    if (wi == worlds_.end()) return;
    World& w = *wi->second;
    if (f.closed()) {  // the first unanswered one failed; the server served none after it
      adds_conns_.erase(w.adds_conn);
      w.adds_conn = 0;
      w.forget_all();
      std::deque<std::string> flying = std::exchange(w.adds_flying, {});
      if (flying.empty()) return;
      Adder& failed = w.adders[flying.front()];
      failed.flies = false;
      const AddBatch lost = std::exchange(failed.flying, {});
      if (!failed.next.members.empty() && !failed.queued) queue_launch(w, flying.front());
      flying.pop_front();
      // Those after it, not served, go again in their order on a new connection (their ADDs
      // are in the replay log already).
      for (const std::string& key : flying) send_add(w, key, w.adders[key].flying);
      for (const auto& [m, delta] : lost.members) {
        if (m->closed) continue;
        ++n_closed_;
        spdlog::warn("store relay: the server closed the connection from {}: {}", name_of(m->from),
                     f.error());
        drop(m, false);
      }
      return;
    }
    std::vector<LocalPtr> answered;
    for (std::size_t at = 0; at + 8 <= f.data().size() && !w.adds_flying.empty(); at += 8) {
      std::int64_t total = 0;
      std::memcpy(&total, f.data().data() + at, 8);
      const std::string key = std::move(w.adds_flying.front());
      w.adds_flying.pop_front();
      auto it = w.adders.find(key);
      if (it == w.adders.end()) continue;
      Adder& a = it->second;
      a.flies = false;
      AddBatch b = std::exchange(a.flying, {});
      std::vector<std::int64_t> deltas;
      for (const auto& [m, delta] : b.members) deltas.push_back(delta);
      const std::vector<std::int64_t> each = relay::combined_answers(total, deltas);
      for (std::size_t i = 0; i < b.members.size(); ++i) {
        const LocalPtr& m = b.members[i].first;
        if (m->closed) continue;
        tcpstore::put_i64(m->out, each[i]);
        m->held = false;
        --n_adds_held_;
        answered.push_back(m);
      }
      if (!a.next.members.empty()) {
        launch(w, key);
      } else if (!a.queued) {
        w.adders.erase(it);
      }
    }
    for (const LocalPtr& m : answered) {  // what they sent after their ADD goes on
      if (m->closed) continue;
      process(m);
      read(m);
    }
  }

  // c's WAIT rides on another connection's, for the same keys, already at the server.
  void join_wait(const LocalPtr& c, const Request& req) {
    auto g = c->world->waits.find(waiters_name(req.keys));
    g->second.add(c);
    c->follows = g->first;
    ++n_waits_joined_;
  }

  // The leader c's WAIT was answered (`value`: the one key's, when it came with it): so are
  // those that rode on it.
  void answer_followers(const LocalPtr& c, const std::string* value) {
    auto g = c->world->waits.find(c->leads);
    c->leads.clear();
    if (g == c->world->waits.end()) return;
    Waiters ws = std::move(g->second);
    c->world->waits.erase(g);
    for (const LocalPtr& m : ws.followers) {
      m->follows.clear();
      if (m->closed) continue;
      tcpstore::put_u8(m->out, tcpstore::kStopWaiting);
      if (value != nullptr && ws.keys.size() == 1) m->stash.emplace(ws.keys[0], *value);
      flush(m);
    }
  }

  // The leader c of a WAIT others ride on goes or cancels its WAIT: one of them sends its own
  // and leads in its place (none left: the group ends).
  void hand_on(Local& c) {
    auto g = c.world->waits.find(c.leads);
    c.leads.clear();
    if (g == c.world->waits.end()) return;
    Waiters& ws = g->second;
    if (ws.followers.empty() || c.world->closing) {
      for (const LocalPtr& m : ws.followers) m->follows.clear();
      c.world->waits.erase(g);
      return;
    }
    LocalPtr next = std::move(ws.followers.back());
    ws.followers.pop_back();
    next->follows.clear();
    ws.leader = next;
    next->leads = g->first;
    send_wait(next, ws.keys, true);
  }

  void stop_leading(Local& c) {
    for (Owed& o : c.inflight) o.leads = false;
    hand_on(c);
  }

  // c's WAIT rode on another's and c sends more: its WAIT goes up after all, before the rest.
  void ask_alone(const LocalPtr& c) {
    auto g = c->world->waits.find(c->follows);
    c->follows.clear();
    if (g == c->world->waits.end()) return;
    g->second.remove(*c);
    send_wait(c, g->second.keys, false);
  }

  void send_wait(const LocalPtr& c, const std::vector<std::string>& keys, bool leads) {
    Request wait;
    wait.op = Op::kWait;
    wait.keys = keys;
    std::string frame = tcpstore::encode(c->dialect, wait);
    c->inflight.push_back(Owed{Op::kWait, frame, leads});
    c->inflight_bytes += frame.size();
    ++n_waits_sent_;
    if (keys.size() == 1) c->wait_key = keys[0];
    if (up_ != nullptr) up_frame(c, std::move(frame), keys.size() == 1 ? &keys[0] : nullptr);
  }

  // A read c's node set the keys of, answered here (c waits for no answer of the server: the
  // replies stay in order). False: the server answers it.
  bool answer_here(Local& c, const Request& req) {
    return caches_ && c.inflight.empty() && c.world->cache.answer(req, c.out);
  }

  void forget_all() {
    for (auto& [round, w] : worlds_) w->forget_all();
  }

  // Hands `data` (whole frames of c) to the stream; a WAIT's frame is kept to be asked again.
  void up_frame(const LocalPtr& c, std::string data, const std::string* prefetch,
                bool later = false) {
    if (data.empty()) return;
    v1::RelayFrame f;
    f.set_conn(c->id);
    if (!c->opened) {
      f.set_round(c->world->round);
      c->opened = true;
      // Its VALIDATE stayed here (process): the server learns its dialect from it.
      if (c->dialect == Dialect::kTorch2) data.insert(0, validate_);
    }
    if (prefetch != nullptr) {
      f.set_prefetch(*prefetch);
      f.set_has_prefetch(true);
    }
    f.set_data(std::move(data));
    up_->send(std::move(f), later);
    if (!later) {
      nothing_behind();  // they went with it
    } else if (behind_.held(std::chrono::steady_clock::now())) {
      arm_behind();
    }
  }

  // The timer for what waits behind. One called off whose handler has not run yet still
  // counts as armed: that handler arms it again when writes were held back since.
  // What waits behind goes up write_behind after the first of it came if the node's workers
  // sent nothing more meanwhile, write_behind_max after it if they did (one wake-up to find
  // out, not one per pause of a busy node).
  void arm_behind() {
    if (behind_armed_ || !behind_.holding() || stopping_) return;
    behind_armed_ = true;
    behind_timer_.expires_at(*behind_.due());
    behind_timer_.async_wait([this, self = shared_from_this()](const boost::system::error_code& ec) {
      behind_armed_ = false;
      if (ec || !behind_.holding() || !behind_.fired(last_query_)) return arm_behind();
      send_behind(true);
    });
  }

  // The writes held back go up when due (`due`: the timer says so; otherwise checked as
  // queries come, which spares the loop the timer's wake-up when they keep coming).
  void send_behind(bool due) {
    if (!behind_.holding() || up_ == nullptr) return;
    if (!due && !behind_.overdue(last_query_)) return;
    nothing_behind();
    up_->kick();
  }

  // Nothing waits behind any more: the timer is called off (no wake-up for nothing).
  void nothing_behind() {
    behind_.sent();
    if (behind_armed_) behind_timer_.cancel();
  }

  void arm_partial(const LocalPtr& c, bool progressed) {
    if (c->in.empty() || c->held) {  // held: what it holds is whole frames that wait
      if (c->partial_armed) c->partial.cancel();
      c->partial_armed = false;
      return;
    }
    if (c->partial_armed && !progressed) return;
    c->partial_armed = true;
    c->partial.expires_after(opts_.partial_frame_timeout);
    c->partial.async_wait([this, self = shared_from_this(), c](const boost::system::error_code& ec) {
      if (ec || c->closed || c->in.empty()) return;
      fail(c, "a frame left half-sent for " +
                  std::to_string(opts_.partial_frame_timeout.count()) + " ms");
    });
  }

  void flush(const LocalPtr& c) {
    if (c->closed || c->out.empty()) return;
    if (c->out.size() + c->sending.size() > opts_.max_unsent_bytes) {
      return fail(c, "it does not read its replies (" +
                         std::to_string(c->out.size() + c->sending.size()) + " bytes unsent)");
    }
    if (c->writing) return;
    boost::system::error_code ec;
    const std::size_t n = c->sock.write_some(asio::buffer(c->out), ec);
    if (ec && ec != asio::error::would_block) return drop(c, true);
    if (!ec && n == c->out.size()) {
      c->out.clear();
      if (c->out.capacity() > (64 << 10)) std::string().swap(c->out);
      return;
    }
    c->out.erase(0, ec ? 0 : n);
    c->sending.swap(c->out);
    c->out.clear();
    c->writing = true;
    asio::async_write(c->sock, asio::buffer(c->sending),
                      [this, self = shared_from_this(), c](const boost::system::error_code& ec,
                                                           std::size_t) {
                        c->writing = false;
                        if (c->closed) return;
                        if (ec) return drop(c, true);
                        c->sending.clear();
                        flush(c);
                      });
  }

  void fail(const LocalPtr& c, const std::string& why) {
    if (c->closed) return;
    ++n_closed_;
    spdlog::warn("store relay: closed the connection from {}: {}", name_of(c->from), why);
    drop(c, true);
  }

  // Closes c; `tell`: the server is told (its end of the connection goes too).
  void drop(const LocalPtr& c, bool tell) {
    if (c->closed) return;
    c->closed = true;
    if (c->held) --n_adds_held_;
    if (tell && c->opened && up_ != nullptr) {
      v1::RelayFrame f;
      f.set_conn(c->id);
      f.set_closed(true);
      up_->send(std::move(f));
    }
    if (!c->leads.empty()) hand_on(*c);
    if (!c->follows.empty()) {
      auto g = c->world->waits.find(c->follows);
      if (g != c->world->waits.end()) g->second.remove(*c);
      c->follows.clear();
    }
    boost::system::error_code ec;
    c->partial.cancel();
    c->sock.close(ec);
    c->world->conns.erase(c);
    by_id_.erase(c->id);
    --n_conns_;
  }

  StoreRelayOptions opts_;
  asio::io_context& io_;
  tcpstore::FrameLimits frame_;
  asio::steady_timer reconnect_;
  asio::steady_timer ready_timer_;
  // Writes waiting in the stream's queue for company (write-behind): the rule, and its timer.
  relay::WriteBehind behind_;
  asio::steady_timer behind_timer_;
  bool behind_armed_ = false;
  std::chrono::steady_clock::time_point last_query_{};  // when a worker's frames came last
  std::vector<char> buf_;
  const std::string validate_ = [] {
    Request v;
    v.op = Op::kValidate;
    v.number = tcpstore::kValidationMagic;
    return tcpstore::encode(Dialect::kTorch2, v);
  }();
  // The worlds' connections for combined ADDs on this stream, and their rounds.
  std::unordered_map<std::uint64_t, int> adds_conns_;
  PeerUid peer_uid_;
  const uid_t euid_ = ::geteuid();
  std::vector<std::unique_ptr<v1::StoreRelay::Stub>> stubs_;
  std::size_t target_ = 0;
  RelayUpstream* up_ = nullptr;  // the stream now (the loop's)
  bool ready_ = false;           // the server said it serves the stream
  bool caches_ = false;          // and tells this relay what its node set that others wrote
  std::string last_end_;  // the reason last logged for a stream's end
  bool stopping_ = false;
  std::map<int, std::unique_ptr<World>> worlds_;
  std::unordered_map<std::uint64_t, LocalPtr> by_id_;
  std::vector<LocalPtr> paused_;
  std::uint64_t next_id_ = 1;  // 0 is the server's "ready"
  std::uint64_t replaying_ = 0;  // writes the stream now opening carries again
  absl::Mutex live_mu_;
  int live_upstreams_ ABSL_GUARDED_BY(live_mu_) = 0;
  std::atomic<std::size_t> n_conns_{0}, n_adds_held_{0};
  std::atomic<std::uint64_t> n_other_user_{0}, n_refused_{0}, n_closed_{0}, n_streams_{0},
      n_gets_here_{0}, n_replayed_{0}, n_reads_here_{0}, n_combined_adds_{0},
      n_adds_combined_{0}, n_waits_joined_{0}, n_waits_sent_{0};
};

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
