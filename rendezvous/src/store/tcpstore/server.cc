#include "muster/rendezvous/tcpstore_server.h"

#include <atomic>
#include <deque>
#include <future>
#include <memory>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <boost/asio.hpp>
#include <spdlog/spdlog.h>

#include "muster/rendezvous/kv_table.h"
#include "store/tcpstore/protocol.h"

namespace muster::rendezvous {

namespace asio = boost::asio;
using asio::ip::tcp;
using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Parsed;
using tcpstore::Request;

namespace {

// Bytes one readable event takes from a socket at most (into the server's one buffer; only
// what is left of a half-received frame is kept per connection).
constexpr std::size_t kReadChunk = 64 << 10;

struct Conn {
  explicit Conn(tcp::socket s, asio::io_context& io) : sock(std::move(s)), partial(io) {}
  tcp::socket sock;
  asio::steady_timer partial;  // a half-sent frame's deadline
  std::string peer;
  Dialect dialect = Dialect::kUnknown;
  std::string in;         // the unparsed rest of what was read
  std::string out;        // replies not yet handed to the socket
  std::string sending;    // replies the socket is writing now
  bool writing = false;
  bool reading = false;
  bool closed = false;
  bool partial_armed = false;  // `partial` runs for the frame `in` holds the start of
  // A parked WAIT: the keys still missing (a key named twice counts once per name).
  std::size_t awaited = 0;
  std::vector<std::string> wait_keys;
};
using ConnPtr = std::shared_ptr<Conn>;

}  // namespace

class TcpStoreLoop {
 public:
  TcpStoreLoop() : work_(asio::make_work_guard(io_)), thread_([this] { io_.run(); }) {}
  // Lets the thread finish what is queued (the handlers of closed servers), then joins it.
  ~TcpStoreLoop() {
    work_.reset();
    thread_.join();
  }
  asio::io_context& io() { return io_; }

 private:
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
};

std::shared_ptr<TcpStoreLoop> make_tcpstore_loop() { return std::make_shared<TcpStoreLoop>(); }

// Every handler holds the Impl (shared_from_this), so that a server closed while its sockets'
// handlers are still queued is freed by the last of them, on the loop's thread.
class TcpStoreServer::Impl : public std::enable_shared_from_this<TcpStoreServer::Impl> {
 public:
  Impl(TcpStoreOptions o, asio::io_context& io)
      : opts_(std::move(o)),
        table_(opts_.limits),
        io_(io),
        acceptor_(io_),
        frame_{opts_.limits.max_key_bytes, opts_.limits.max_value_bytes,
               opts_.limits.max_keys_per_request, opts_.max_frame_bytes},
        buf_(kReadChunk) {}

  absl::Status listen() {
    boost::system::error_code ec;
    const auto addr = asio::ip::make_address(opts_.host, ec);
    if (ec) return absl::InvalidArgumentError("tcpstore: bad listen address '" + opts_.host + "'");
    tcp::endpoint ep(addr, static_cast<unsigned short>(opts_.port));
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError("tcpstore: cannot listen on " + opts_.host + ":" +
                                    std::to_string(opts_.port) + ": " + ec.message());
    }
    port_ = acceptor_.local_endpoint().port();
    return absl::OkStatus();
  }

  // On the loop: starts accepting (after listen(), once the Impl is owned by a shared_ptr).
  void begin() {
    asio::post(io_, [this, self = shared_from_this()] { accept(); });
  }

  // Closes the listener and every connection, on the loop, and returns when that is done.
  void shutdown() {
    std::promise<void> done;
    asio::post(io_, [this, self = shared_from_this(), &done] {
      boost::system::error_code ec;
      acceptor_.close(ec);
      for (auto& c : std::vector<ConnPtr>(conns_.begin(), conns_.end())) drop(c);
      done.set_value();
    });
    done.get_future().wait();
  }

  int port() const { return port_; }

  Stats stats() const {
    Stats s;
    s.connections = n_conns_.load();
    s.keys = n_keys_.load();
    s.parked_waits = n_waits_.load();
    s.closed_for_errors = n_closed_.load();
    s.refused_connections = n_refused_.load();
    return s;
  }

 private:
  void accept() {
    acceptor_.async_accept([this, self = shared_from_this()](const boost::system::error_code& ec,
                                                               tcp::socket s) {
      if (ec == asio::error::operation_aborted) return;
      if (!ec) on_accept(std::move(s));
      accept();
    });
  }

  void on_accept(tcp::socket s) {
    boost::system::error_code ec;
    const auto remote = s.remote_endpoint(ec);
    const std::string peer = ec ? "?" : remote.address().to_string() + ":" +
                                            std::to_string(remote.port());
    if (conns_.size() >= opts_.max_connections) {
      ++n_refused_;
      // One line per refusal would be a flood at the limit: the first, then every 1000th.
      if (n_refused_ % 1000 == 1) {
        spdlog::warn("tcpstore: refused a connection from {}: at the limit of {} connections "
                     "({} refused so far)",
                     peer, opts_.max_connections, n_refused_.load());
      }
      s.close(ec);
      return;
    }
    s.set_option(tcp::no_delay(true), ec);
    s.non_blocking(true, ec);
    auto c = std::make_shared<Conn>(std::move(s), io_);
    c->peer = peer;
    conns_.insert(c);
    n_conns_ = conns_.size();
    read(c);
  }

  void read(const ConnPtr& c) {
    if (c->closed || c->reading) return;
    c->reading = true;
    c->sock.async_wait(tcp::socket::wait_read, [this, self = shared_from_this(),
                                                c](const boost::system::error_code& ec) {
      c->reading = false;
      if (c->closed) return;
      if (ec) return drop(c);
      on_readable(c);
    });
  }

  void on_readable(const ConnPtr& c) {
    boost::system::error_code ec;
    const std::size_t n = c->sock.read_some(asio::buffer(buf_), ec);
    if (ec == asio::error::would_block) return read(c);
    if (ec || n == 0) return drop(c);  // EOF or reset: a client that went
    c->in.append(buf_.data(), n);
    std::size_t pos = 0;
    Request req;
    while (!c->closed && pos < c->in.size()) {
      const auto r = tcpstore::parse(c->dialect, c->in.data() + pos, c->in.size() - pos, frame_,
                                     req);
      if (r.what == Parsed::kNeedMore) break;
      if (r.what == Parsed::kError) return fail(c, r.error);
      pos += r.consumed;
      serve(c, req);
    }
    if (c->closed) return;
    c->in.erase(0, pos);
    if (c->in.empty() && c->in.capacity() > 4096) std::string().swap(c->in);
    arm_partial(c, pos > 0);
    flush(c);
    read(c);
  }

  // A half-sent frame must be finished within partial_frame_timeout of its first byte (bytes
  // that trickle in do not extend it; a frame completed does).
  void arm_partial(const ConnPtr& c, bool progressed) {
    if (c->in.empty()) {
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

  // One query, answered into c->out (the protocol's replies; nothing for SET-like queries).
  void serve(const ConnPtr& c, Request& r) {
    std::string& o = c->out;
    switch (r.op) {
      case Op::kValidate:
        return;
      case Op::kPing:
        return tcpstore::put_u32(o, r.number);
      case Op::kSet:
        return set(c, r.keys[0], std::move(r.values[0]), tcpstore::kWatchUpdated);
      case Op::kAppend: {
        const std::string* v = table_.find(r.keys[0]);
        std::string joined = v != nullptr ? *v + r.values[0] : std::move(r.values[0]);
        return set(c, r.keys[0], std::move(joined), tcpstore::kWatchAppended);
      }
      case Op::kCompareSet:
        return compare_set(c, r);
      case Op::kGet:
      case Op::kMultiGet:
        for (const auto& k : r.keys) {
          const std::string* v = table_.find(k);
          tcpstore::put_bytes(o, v != nullptr ? *v : std::string());
        }
        return;
      case Op::kAdd:
        return add(c, r);
      case Op::kCheck:
        return tcpstore::put_u8(o, present(r.keys) ? tcpstore::kCheckReady
                                                   : tcpstore::kCheckNotReady);
      case Op::kWait:
        return wait(c, r.keys);
      case Op::kNumKeys:
        return tcpstore::put_i64(o, static_cast<std::int64_t>(table_.size()));
      case Op::kDelete:
        return erase(c, r.keys[0]);
      case Op::kWatchKey:
        watchers_[r.keys[0]].push_back(c);
        return tcpstore::put_u8(o, tcpstore::kWatchRegistered);
      case Op::kMultiSet:
        if (absl::Status s = table_.multi_set(r.keys, r.values); !s.ok()) {
          return fail(c, "MULTI_SET: " + std::string(s.message()));
        }
        n_keys_ = table_.size();
        for (const auto& k : r.keys) wake(k, false);
        return;
      case Op::kCancelWait:
        unpark(c);
        return tcpstore::put_u8(o, tcpstore::kWaitCanceled);
      case Op::kQueuePush:
      case Op::kQueuePop:
      case Op::kQueueLen:
        return queue(c, r);
    }
  }

  // The value `key` had, for a watcher's update; only copied when someone watches it.
  std::string old_value(const std::string& key, const std::string* before) const {
    return before != nullptr && watchers_.count(key) != 0 ? *before : std::string();
  }

  void compare_set(const ConnPtr& c, const Request& r) {
    const std::string& key = r.keys[0];
    const std::string &expected = r.values[0], &desired = r.values[1];
    const std::string* before = table_.find(key);
    const bool existed = before != nullptr;
    // c10d's rule (KvTable::compare_set): a missing key is set only when `expected` is empty.
    const bool changes = existed ? *before == expected && desired != expected : expected.empty();
    const std::string old = old_value(key, before);
    auto got = table_.compare_set(key, expected, desired);
    if (!got.ok()) return fail(c, "COMPARE_SET: " + std::string(got.status().message()));
    n_keys_ = table_.size();
    tcpstore::put_bytes(c->out, *got);
    if (changes) {
      changed(key, existed ? tcpstore::kWatchUpdated : tcpstore::kWatchCreated, old, desired);
      wake(key, false);
    }
  }

  void add(const ConnPtr& c, const Request& r) {
    const std::string& key = r.keys[0];
    const std::string* before = table_.find(key);
    const bool existed = before != nullptr;
    const std::string old = old_value(key, before);
    auto sum = table_.add(key, r.delta);
    if (!sum.ok()) return fail(c, "ADD: " + std::string(sum.status().message()));
    n_keys_ = table_.size();
    tcpstore::put_i64(c->out, *sum);
    wake(key, false);
    changed(key, existed ? tcpstore::kWatchUpdated : tcpstore::kWatchCreated, old,
            *table_.find(key));
  }

  void erase(const ConnPtr& c, const std::string& key) {
    const std::string old = old_value(key, table_.find(key));
    const bool erased = table_.erase(key);
    n_keys_ = table_.size();
    tcpstore::put_i64(c->out, erased ? 1 : 0);
    if (erased) changed(key, tcpstore::kWatchDeleted, old, "");
  }

  // QUEUE_PUSH (no reply; wakes one waiter), QUEUE_POP (the length, then the value when there
  // is one; never waits), QUEUE_LEN.
  void queue(const ConnPtr& c, Request& r) {
    const std::string& key = r.keys[0];
    auto it = queues_.find(key);
    const std::size_t n = it == queues_.end() ? 0 : it->second.size();
    if (r.op == Op::kQueueLen) return tcpstore::put_i64(c->out, static_cast<std::int64_t>(n));
    if (r.op == Op::kQueuePop) {
      tcpstore::put_i64(c->out, static_cast<std::int64_t>(n));
      if (n == 0) return;
      tcpstore::put_bytes(c->out, it->second.front());
      queue_bytes_ -= key.size() + it->second.front().size();
      it->second.pop_front();
      if (it->second.empty()) queues_.erase(it);
      return;
    }
    const std::size_t bytes = key.size() + r.values[0].size();
    if (table_.bytes() + queue_bytes_ + bytes > opts_.limits.max_bytes) {
      return fail(c, "QUEUE_PUSH: the run's store is full");
    }
    queue_bytes_ += bytes;
    queues_[key].push_back(std::move(r.values[0]));
    wake(key, true);
  }

  void set(const ConnPtr& c, const std::string& key, std::string value, std::uint8_t kind) {
    const std::string* before = table_.find(key);
    const bool existed = before != nullptr;
    const std::string old = old_value(key, before);
    if (absl::Status s = table_.set(key, value); !s.ok()) {
      return fail(c, std::string(s.message()));
    }
    n_keys_ = table_.size();
    changed(key, existed ? kind : tcpstore::kWatchCreated, old, value);
    wake(key, false);
  }

  bool present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (table_.find(k) != nullptr) continue;
      auto q = queues_.find(k);
      if (q == queues_.end() || q->second.empty()) return false;
    }
    return true;
  }

  void wait(const ConnPtr& c, const std::vector<std::string>& keys) {
    if (present(keys)) {
      tcpstore::put_u8(c->out, tcpstore::kStopWaiting);
      return;
    }
    if (c->awaited > 0) return fail(c, "WAIT while its previous WAIT is still parked");
    if (n_waits_ >= opts_.max_waits) {
      return fail(c, "WAIT: " + std::to_string(opts_.max_waits) + " waits are parked already");
    }
    for (const auto& k : keys) {
      if (table_.find(k) != nullptr) continue;
      auto q = queues_.find(k);
      if (q != queues_.end() && !q->second.empty()) continue;
      waiters_[k].push_back(c);
      c->wait_keys.push_back(k);
      ++c->awaited;
    }
    ++n_waits_;
  }

  // `key` was written: its waiters are one key nearer (one of them only, for a queue push).
  void wake(const std::string& key, bool one) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    auto& list = it->second;
    while (!list.empty()) {
      ConnPtr w = list.front().lock();
      list.pop_front();
      if (!w || w->closed || w->awaited == 0) continue;
      if (--w->awaited == 0) {
        w->wait_keys.clear();
        --n_waits_;
        tcpstore::put_u8(w->out, tcpstore::kStopWaiting);
        flush(w);
        if (one) break;
      }
    }
    if (list.empty()) waiters_.erase(it);
  }

  // Takes c's parked WAIT out (CANCEL_WAIT, or the connection went).
  void unpark(const ConnPtr& c) {
    if (c->awaited == 0) return;
    for (const auto& k : c->wait_keys) {
      auto it = waiters_.find(k);
      if (it == waiters_.end()) continue;
      auto& list = it->second;
      for (auto w = list.begin(); w != list.end();) {
        auto p = w->lock();
        w = (!p || p == c) ? list.erase(w) : std::next(w);
      }
      if (list.empty()) waiters_.erase(it);
    }
    c->wait_keys.clear();
    c->awaited = 0;
    --n_waits_;
  }

  // WATCH_KEY (torch 1.13's callback connection): the change, to every watcher of `key`.
  void changed(const std::string& key, std::uint8_t kind, const std::string& old,
               const std::string& now) {
    auto it = watchers_.find(key);
    if (it == watchers_.end()) return;
    for (auto w = it->second.begin(); w != it->second.end();) {
      ConnPtr p = w->lock();
      if (!p || p->closed) {
        w = it->second.erase(w);
        continue;
      }
      tcpstore::put_u8(p->out, kind);
      tcpstore::put_bytes(p->out, key);
      tcpstore::put_bytes(p->out, kind == tcpstore::kWatchCreated ? std::string() : old);
      tcpstore::put_bytes(p->out, now);
      flush(p);
      ++w;
    }
    if (it->second.empty()) watchers_.erase(it);
  }

  void flush(const ConnPtr& c) {
    if (c->closed || c->out.empty()) return;
    if (c->out.size() + c->sending.size() > opts_.max_unsent_bytes) {
      return fail(c, "it does not read its replies (" +
                         std::to_string(c->out.size() + c->sending.size()) + " bytes unsent)");
    }
    if (c->writing) return;
    // Most replies fit the socket's buffer: written at once, with no handler to queue.
    boost::system::error_code ec;
    const std::size_t n = c->sock.write_some(asio::buffer(c->out), ec);
    if (ec && ec != asio::error::would_block) return drop(c);
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
                        if (ec) return drop(c);
                        c->sending.clear();
                        if (c->sending.capacity() > (64 << 10)) std::string().swap(c->sending);
                        flush(c);
                      });
  }

  // Closes c for something it did, with the log line the protocol cannot send it.
  void fail(const ConnPtr& c, const std::string& why) {
    if (c->closed) return;
    ++n_closed_;
    spdlog::warn("tcpstore: closed the connection from {}: {}", c->peer, why);
    drop(c);
  }

  void drop(const ConnPtr& c) {
    if (c->closed) return;
    unpark(c);
    c->closed = true;
    boost::system::error_code ec;
    c->partial.cancel();
    c->sock.close(ec);
    conns_.erase(c);
    n_conns_ = conns_.size();
  }

  TcpStoreOptions opts_;
  KvTable table_;
  asio::io_context& io_;
  tcp::acceptor acceptor_;
  tcpstore::FrameLimits frame_;
  std::vector<char> buf_;
  std::unordered_set<ConnPtr> conns_;
  std::unordered_map<std::string, std::deque<std::weak_ptr<Conn>>> waiters_;
  std::unordered_map<std::string, std::vector<std::weak_ptr<Conn>>> watchers_;
  std::unordered_map<std::string, std::deque<std::string>> queues_;
  std::size_t queue_bytes_ = 0;
  int port_ = 0;
  std::atomic<std::size_t> n_conns_{0}, n_keys_{0}, n_waits_{0};
  std::atomic<std::uint64_t> n_closed_{0}, n_refused_{0};
};

TcpStoreServer::TcpStoreServer(std::shared_ptr<TcpStoreLoop> loop, std::shared_ptr<Impl> impl)
    : loop_(std::move(loop)), impl_(std::move(impl)) {}

TcpStoreServer::~TcpStoreServer() {
  impl_->shutdown();
  impl_.reset();  // the queued handlers of its closed sockets hold it until they have run
  loop_.reset();  // the last holder of the loop joins its thread
}

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(
    TcpStoreOptions options, std::shared_ptr<TcpStoreLoop> loop) {
  if (options.max_frame_bytes < 16) return absl::InvalidArgumentError("tcpstore: max_frame_bytes");
  if (!loop) loop = make_tcpstore_loop();
  auto impl = std::make_shared<Impl>(std::move(options), loop->io());
  if (absl::Status s = impl->listen(); !s.ok()) return s;
  impl->begin();
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(loop), std::move(impl)));
}

int TcpStoreServer::port() const { return impl_->port(); }

TcpStoreServer::Stats TcpStoreServer::stats() const { return impl_->stats(); }

}  // namespace muster::rendezvous
