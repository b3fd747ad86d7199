// The store relay's loop-side object (store_relay.h), shared by its rooms and nothing else:
// store_relay.cc (the worlds' listeners, the stream's life, what comes down),
// store_relay_conns.cc (a worker's socket: frames read, answered here or sent up, replies
// written back), store_relay_combine.cc (a node's ADDs combined, WAITs riding on one). The
// rules that need no socket are relay_rules.h; the stream is relay_upstream.h.
#pragma once

#include "muster/rendezvous/store_relay.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <optional>
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
#include "common/tcpstore_socket.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {
namespace relay_internal {

namespace asio = boost::asio;
using asio::ip::tcp;
using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Parsed;
using tcpstore::Request;


using tcpstore::kReadChunk;
// Connections one readable event of a listener takes at most (the loop's other work waits):
// as many as one owner query asks about.
constexpr std::size_t kAcceptBurst = PeerUid::kMaxBatch;

struct World;

// A query the server owes a connection an answer to: its frame (a new stream asks again those
// that only read); `leads`: a WAIT other connections' WAITs ride on (World::waits).
struct Owed {
  Op op;
  std::string frame;
  bool leads = false;
};

// One worker's connection (the loop's).
struct Local : std::enable_shared_from_this<Local> {
  Local(tcp::socket s, asio::io_context& io, std::uint64_t id, World* w)
      : wire(std::move(s), io), id(id), world(w) {}
  tcpstore::Socket wire;  // its socket: what it sent unparsed, replies being written
  const std::uint64_t id;
  World* const world;
  sockaddr_in from{};  // its address (sin_family 0: not known), named in logs only
  Dialect dialect = Dialect::kUnknown;
  std::string out;  // replies not yet handed to `wire`
  bool closed = false;
  bool opened = false;     // the current stream has had its first frame (its round)
  bool watching = false;   // WATCH_KEY (torch 1.13): not carried over to a new stream
  // Its queries the server has not answered yet, in order.
  // A list: nothing allocated while none is owed (an empty deque holds 576 bytes).
  std::list<Owed> inflight;
  std::size_t inflight_bytes = 0;
  bool held = false;    // its ADD went up in a combined one: what it sent after waits
  std::optional<std::string> wait_key;  // its WAIT's key, when the value comes with the answer
  std::optional<std::pair<std::string, std::string>> stash;  // key, value: for the next GET
};
using LocalPtr = std::shared_ptr<Local>;

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
  // Combined ADDs (relay_rules.h) and the relay's own connection on this stream that carries
  // them (0: none yet).
  relay::AddCombiner<LocalPtr> adds;
  std::uint64_t adds_conn = 0;
  // WAITs that others ride on, and who rides on them (relay_rules.h).
  relay::WaitGroups<LocalPtr> waits;
  bool closing = false;  // its connections are being closed: no WAIT is handed on
  void forget_all() { cache.forget_all(); }
};


}  // namespace relay_internal

namespace asio = boost::asio;

class StoreRelay::Impl : public RelayUpstreamSink,
                         public std::enable_shared_from_this<StoreRelay::Impl> {
  using World = relay_internal::World;
  using Local = relay_internal::Local;
  using LocalPtr = relay_internal::LocalPtr;
  using tcp = relay_internal::tcp;
  using Request = relay_internal::Request;

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
        buf_(relay_internal::kReadChunk) {}

  // --- any thread ---------------------------------------------------------------------------

  absl::StatusOr<int> world(int round);
  void shutdown();
  Stats stats() const;

  // --- the upstream's, handed over to the loop -----------------------------------------------

  // The stream has taken what made read() pause: the paused connections are read on.
  void drained(RelayUpstream* up) override;
  void on_down(RelayUpstream* up, v1::RelayDown& msg) override;

  // The stream failed (its read ended): the connections wait for the next one.
  void on_lost(RelayUpstream* up) override;

  // Why a stream ended, in the log (once while the same reason repeats). A refusal that
  // another try cannot change (a token that does not open the run) ends the connections.
  void ended(const grpc::Status& s) override;
  void upstream_done() override;

 private:
  absl::StatusOr<int> open_world(int round);
  void close_world(std::map<int, std::unique_ptr<World>>::iterator it);
  void accept(World* w);

  struct Accepted {
    tcp::socket sock;
    sockaddr_in from;  // sin_family 0: not an IPv4 peer
  };
  static sockaddr_in address_of(const tcp::endpoint& e);

  // A burst of accepted connections: those of another user refused, the others served.
  void take(World* w, std::vector<Accepted>& burst);

  // "IP:PORT" of a worker's address (for logs).
  static std::string name_of(const sockaddr_in& a);

  // `mine`: its socket is this process's user's (or anyone may connect).
  void on_accept(World* w, tcp::socket s, const sockaddr_in& remote, bool mine);

  // The stream, opened when there is none: the run and the token, then what this node's
  // workers wrote in each world, then the connections carried over from a stream lost.
  void ensure_stream();
  void make_stubs();
  void replay(World& w);

  // A connection of the stream before goes on if what the server owes it only reads (a GET,
  // a WAIT...): those are asked again. One with a write in flight (ADD, COMPARE_SET, DELETE, a
  // queue's pop) or a WATCH_KEY is closed: nobody can say whether the write was served.
  void carry_over(const LocalPtr& c);

  // The combined ADDs in flight on the stream lost: their workers' connections are closed
  // (nobody can say whether the ADD was served); those not sent yet go on the new stream.
  void lose_adds(World& w);
  void on_ready(bool caches);

  // --- a worker's socket ---------------------------------------------------------------------

  void read(const LocalPtr& c);
  void on_readable(const LocalPtr& c);

  // The whole frames c sent, as far as they can go now (not past an ADD of c's combined with
  // others: what follows it waits for its answer).
  void process(const LocalPtr& c);

  // What a query means for the relay: the log of writes, the answers owed. False: c was
  // closed (too much in flight).
  bool note(Local& c, const Request& req, const char* frame, std::size_t size);
  void log_write(World& w, const Request& req);

  // --- combining a node's ADDs and WAITs ------------------------------------------------------

  // Whether `req` of c rides with others': an ADD, or a WAIT for keys another connection of
  // the node waits for at the server; c waits for no answer of the server (its replies stay
  // in order).
  bool combines(const Local& c, const Request& req) const;

  // c's ADD joins the next combined ADD of its key; c is held until it is answered.
  void join_add(const LocalPtr& c, const Request& req);

  // The next combined ADD of `key` goes up once the loop has read what is ready now (the ADDs
  // that came together go together).
  void queue_launch(World& w, const std::string& key);
  void launch(World& w, const std::string& key);
  static Request add_of(const std::string& key, std::int64_t sum);

  // The combined ADD of `sum` to `key` on w's connection for them (opened on this stream
  // first).
  void send_add(World& w, const std::string& key, std::int64_t sum);

  // Answers on a world's connection for combined ADDs: each member gets the sum as if the
  // batch's ADDs had been applied one after another.
  void on_adds(int round, v1::RelayFrame& f);

  // c's WAIT rides on another connection's, for the same keys, already at the server.
  void join_wait(const LocalPtr& c, const Request& req);

  // The leader c's WAIT was answered (`value`: the one key's, when it came with it): so are
  // those that rode on it.
  void answer_followers(const LocalPtr& c, const std::string* value);

  // The leader c of a WAIT others ride on goes or cancels its WAIT: one of them sends its own
  // and leads in its place (none left: the group ends).
  void hand_on(Local& c);
  void stop_leading(Local& c);

  // c's WAIT rode on another's and c sends more: its WAIT goes up after all, before the rest.
  void ask_alone(const LocalPtr& c);
  void send_wait(const LocalPtr& c, const std::vector<std::string>& keys, bool leads);

  // A read c's node set the keys of, answered here (c waits for no answer of the server: the
  // replies stay in order). False: the server answers it.
  bool answer_here(Local& c, const Request& req);
  void forget_all();

  // Hands `data` (whole frames of c) to the stream; a WAIT's frame is kept to be asked again.
  void up_frame(const LocalPtr& c, std::string data, const std::string* prefetch,
                bool later = false);

  // The timer for what waits behind. One called off whose handler has not run yet still
  // counts as armed: that handler arms it again when writes were held back since.
  // What waits behind goes up write_behind after the first of it came if the node's workers
  // sent nothing more meanwhile, write_behind_max after it if they did (one wake-up to find
  // out, not one per pause of a busy node).
  void arm_behind();

  // The writes held back go up when due (`due`: the timer says so; otherwise checked as
  // queries come, which spares the loop the timer's wake-up when they keep coming).
  void send_behind(bool due);

  // Nothing waits behind any more: the timer is called off (no wake-up for nothing).
  void nothing_behind();
  void arm_partial(const LocalPtr& c, bool progressed);
  void flush(const LocalPtr& c);
  void fail(const LocalPtr& c, const std::string& why);

  // Closes c; `tell`: the server is told (its end of the connection goes too).
  void drop(const LocalPtr& c, bool tell);
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
    v.op = tcpstore::Op::kValidate;
    v.number = tcpstore::kValidationMagic;
    return tcpstore::encode(tcpstore::Dialect::kTorch2, v);
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

}  // namespace muster::rendezvous
