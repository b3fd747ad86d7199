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

#include "common/tcpstore_protocol.h"
#include "common/tcpstore_socket.h"
#include "store/tcpstore/loop.h"
#include "store/tcpstore/table.h"

namespace muster::rendezvous {

namespace asio = boost::asio;
using asio::ip::tcp;
using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Parsed;
using tcpstore::Request;

using tcpstore::kReadChunk;

std::shared_ptr<TcpStoreLoop> make_tcpstore_loop() { return std::make_shared<TcpStoreLoop>(); }

// Every handler holds the Impl (shared_from_this), so that a server closed while its sockets'
// handlers are still queued is freed by the last of them, on the loop's thread.
class TcpStoreServer::Impl : public std::enable_shared_from_this<TcpStoreServer::Impl> {
 public:
  // A client's socket. The table calls flush and fail; the Impl carries them out.
  struct Sock final : tcpstore::Conn {
    Sock(tcp::socket s, asio::io_context& io, Impl* owner) : wire(std::move(s), io), owner(owner) {}
    void flush() override { owner->flush(self()); }
    void fail(const std::string& why) override { owner->fail(self(), why); }
    std::shared_ptr<Sock> self() { return std::static_pointer_cast<Sock>(shared_from_this()); }

    tcpstore::Socket wire;
    Impl* const owner;
    std::string peer;
  };
  using ConnPtr = std::shared_ptr<Sock>;

  Impl(TcpStoreOptions o, asio::io_context& io)
      : opts_(std::move(o)),
        table_(opts_.limits, opts_.max_waits),
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
    auto c = std::make_shared<Sock>(std::move(s), io_, this);
    c->wire.prepare();
    c->peer = peer;
    conns_.insert(c);
    n_conns_ = conns_.size();
    read(c);
  }

  void read(const ConnPtr& c) {
    if (c->closed) return;
    c->wire.await_readable([this, self = shared_from_this(),
                            c](const boost::system::error_code& ec) {
      if (c->closed) return;
      if (ec) return drop(c);
      on_readable(c);
    });
  }

  void on_readable(const ConnPtr& c) {
    switch (c->wire.read_into(buf_)) {
      case tcpstore::Socket::Read::kWouldBlock: return read(c);
      case tcpstore::Socket::Read::kGone: return drop(c);  // EOF or reset: a client that went
      case tcpstore::Socket::Read::kRead: break;
    }
    std::string& in = c->wire.in();
    std::size_t pos = 0;
    Request req;
    while (!c->closed && pos < in.size()) {
      const auto r = tcpstore::parse(c->dialect, in.data() + pos, in.size() - pos, frame_, req);
      if (r.what == Parsed::kNeedMore) break;
      if (r.what == Parsed::kError) return fail(c, r.error);
      pos += r.consumed;
      table_.serve(c, req);
    }
    n_keys_ = table_.keys();
    n_waits_ = table_.parked_waits();
    if (c->closed) return;
    c->wire.consumed(pos);
    c->wire.arm_partial(c->wire.in().empty(), pos > 0, opts_.partial_frame_timeout,
                        [this, self = shared_from_this(), c] {
                          if (c->closed || c->wire.in().empty()) return;
                          fail(c, tcpstore::Socket::half_sent(opts_.partial_frame_timeout));
                        });
    flush(c);
    read(c);
  }

  void flush(const ConnPtr& c) {
    if (c->closed) return;
    const std::size_t unsent = c->wire.unsent(c->out);
    switch (c->wire.send(c->out, opts_.max_unsent_bytes,
                         [this, self = shared_from_this(), c](const boost::system::error_code& ec) {
                           if (c->closed) return;
                           if (ec) return drop(c);
                           flush(c);
                         })) {
      case tcpstore::Socket::Send::kOverLimit:
        return fail(c, tcpstore::Socket::unread(unsent));
      case tcpstore::Socket::Send::kBroken: return drop(c);
      case tcpstore::Socket::Send::kSent:
      case tcpstore::Socket::Send::kWriting: return;
    }
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
    table_.unpark(*c);
    n_waits_ = table_.parked_waits();
    c->closed = true;
    c->wire.close();
    conns_.erase(c);
    n_conns_ = conns_.size();
  }

  TcpStoreOptions opts_;
  tcpstore::Table table_;
  asio::io_context& io_;
  tcp::acceptor acceptor_;
  tcpstore::FrameLimits frame_;
  std::vector<char> buf_;
  std::unordered_set<ConnPtr> conns_;
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
