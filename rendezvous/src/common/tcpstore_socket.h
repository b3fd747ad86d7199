// One client's socket of a TCPStore-protocol front end, shared by the two fronts that serve
// torch's store client: the server's store (store/tcpstore/tcpstore_server.cc) and an agent's
// relay for its node's workers (client/store_relay_conns.cc). It holds what was read and not
// parsed yet, the replies being written, and a half-sent frame's deadline; it reads, writes and
// arms that deadline the same way for both. What a readable socket, a write's end, an error or
// an expired frame mean is the front's: it passes handlers (which keep it alive) and acts on
// what each call returns.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio.hpp>

namespace muster::rendezvous::tcpstore {

// Bytes one readable event takes from a socket at most (into the front's one buffer; only
// what is left of a half-received frame is kept per connection).
inline constexpr std::size_t kReadChunk = 64 << 10;

class Socket {
 public:
  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;

  Socket(tcp::socket s, boost::asio::io_context& io) : sock_(std::move(s)), partial_(io) {}

  // Set up for the loop: no Nagle delay (replies are small and awaited), non-blocking reads.
  void prepare() {
    error_code ec;
    sock_.set_option(tcp::no_delay(true), ec);
    sock_.non_blocking(true, ec);
  }

  // Calls ready(ec) once the socket can be read (or failed); one wait at a time.
  template <class Handler>
  void await_readable(Handler ready) {
    if (reading_) return;
    reading_ = true;
    sock_.async_wait(tcp::socket::wait_read,
                     [this, ready = std::move(ready)](const error_code& ec) mutable {
                       reading_ = false;
                       ready(ec);
                     });
  }
  bool reading() const { return reading_; }

  enum class Read { kRead, kWouldBlock, kGone };
  // What the socket has now, up to buf's size, appended to in(). kGone: end of file or an error
  // (the client went).
  Read read_into(std::vector<char>& buf) {
    error_code ec;
    const std::size_t n = sock_.read_some(boost::asio::buffer(buf), ec);
    if (ec == boost::asio::error::would_block) return Read::kWouldBlock;
    if (ec || n == 0) return Read::kGone;
    in_.append(buf.data(), n);
    return Read::kRead;
  }

  // The unparsed rest of what was read. After the front consumed `n` bytes of it:
  std::string& in() { return in_; }
  void consumed(std::size_t n) {
    in_.erase(0, n);
    if (in_.empty() && in_.capacity() > 4096) std::string().swap(in_);
  }

  // A half-sent frame must be finished within `timeout` of its first byte: bytes that trickle
  // in do not extend it, a frame completed (`progressed`) does. `idle`: nothing half-sent is
  // waiting (the deadline is cancelled). expired() runs when it passes and is still armed.
  template <class Handler>
  void arm_partial(bool idle, bool progressed, std::chrono::milliseconds timeout,
                   Handler expired) {
    if (idle) {
      if (partial_armed_) partial_.cancel();
      partial_armed_ = false;
      return;
    }
    if (partial_armed_ && !progressed) return;
    partial_armed_ = true;
    partial_.expires_after(timeout);
    partial_.async_wait([expired = std::move(expired)](const error_code& ec) mutable {
      if (!ec) expired();
    });
  }

  enum class Send { kSent, kWriting, kOverLimit, kBroken };
  // Writes `out` (and empties it): at once where the socket's buffer takes it all (kSent),
  // else the rest by one async write whose end calls done(ec) (kWriting); with a write under
  // way, `out` waits for the next call. kOverLimit: `out` and what is being written pass
  // max_unsent (a client that does not read its replies); kBroken: the socket failed.
  template <class Handler>
  Send send(std::string& out, std::size_t max_unsent, Handler done) {
    if (out.empty()) return Send::kSent;
    if (out.size() + sending_.size() > max_unsent) return Send::kOverLimit;
    if (writing_) return Send::kWriting;
    error_code ec;
    const std::size_t n = sock_.write_some(boost::asio::buffer(out), ec);
    if (ec && ec != boost::asio::error::would_block) return Send::kBroken;
    if (!ec && n == out.size()) {
      out.clear();
      if (out.capacity() > kKeptCapacity) std::string().swap(out);
      return Send::kSent;
    }
    out.erase(0, ec ? 0 : n);
    sending_.swap(out);
    out.clear();
    writing_ = true;
    boost::asio::async_write(sock_, boost::asio::buffer(sending_),
                             [this, done = std::move(done)](const error_code& ec,
                                                            std::size_t) mutable {
                               writing_ = false;
                               if (!ec) {
                                 sending_.clear();
                                 if (sending_.capacity() > kKeptCapacity) {
                                   std::string().swap(sending_);
                                 }
                               }
                               done(ec);
                             });
    return Send::kWriting;
  }
  // The bytes a client has not read: its replies waiting (`out`) and those being written.
  std::size_t unsent(const std::string& out) const { return out.size() + sending_.size(); }

  // Why a front closes a client, in its one log line: a frame left half-sent past `timeout`
  // (arm_partial's expired()), or `unsent` bytes of replies it does not read (kOverLimit).
  static std::string half_sent(std::chrono::milliseconds timeout) {
    return "a frame left half-sent for " + std::to_string(timeout.count()) + " ms";
  }
  static std::string unread(std::size_t unsent) {
    return "it does not read its replies (" + std::to_string(unsent) + " bytes unsent)";
  }

  // Closes the socket and cancels the deadline (queued handlers run with an error).
  void close() {
    error_code ec;
    partial_.cancel();
    sock_.close(ec);
  }

  tcp::socket& sock() { return sock_; }

 private:
  // A buffer grown past this by a burst is freed once empty.
  static constexpr std::size_t kKeptCapacity = 64 << 10;

  tcp::socket sock_;
  boost::asio::steady_timer partial_;  // a half-sent frame's deadline
  std::string in_;       // the unparsed rest of what was read
  std::string sending_;  // replies the socket is writing now
  bool reading_ = false;
  bool writing_ = false;
  bool partial_armed_ = false;  // `partial_` runs for the frame `in_` holds the start of
};

}  // namespace muster::rendezvous::tcpstore
