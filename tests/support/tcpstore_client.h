// A blocking client of the TCPStore wire protocol for tests and benchmarks: it sends frames
// made by tcpstore::encode (either dialect, or raw bytes) and reads replies with a deadline.
// Header-only; the protocol header is the rendezvous library's private one.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../../rendezvous/src/common/tcpstore_protocol.h"

namespace muster::testing {

class TcpStoreClient {
 public:
  using Dialect = rendezvous::tcpstore::Dialect;
  using Op = rendezvous::tcpstore::Op;
  using Request = rendezvous::tcpstore::Request;

  static constexpr std::chrono::milliseconds kWithin{10000};  // a reply's default deadline

  // Connects to 127.0.0.1:port; torch 2.x's dialect sends VALIDATE first. ok() says whether
  // the connection was made.
  TcpStoreClient(int port, Dialect dialect) : dialect_(dialect) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd_);
      fd_ = -1;
      return;
    }
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (dialect_ == Dialect::kTorch2) {
      Request v;
      v.op = Op::kValidate;
      v.number = rendezvous::tcpstore::kValidationMagic;
      send(v);
    }
  }
  ~TcpStoreClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }

  bool send_raw(const std::string& bytes) {
    std::size_t off = 0;
    while (off < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<std::size_t>(n);
    }
    return true;
  }
  bool send(const Request& r) { return send_raw(rendezvous::tcpstore::encode(dialect_, r)); }

  // Exactly n bytes, or nullopt when the server closed the connection or `within` passed.
  std::optional<std::string> read(std::size_t n, std::chrono::milliseconds within = kWithin) {
    std::string out;
    const auto end = std::chrono::steady_clock::now() + within;
    while (out.size() < n) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          end - std::chrono::steady_clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) != 1)
        return std::nullopt;
      char buf[65536];
      const ssize_t got = ::recv(fd_, buf, std::min(sizeof buf, n - out.size()), 0);
      if (got <= 0) return std::nullopt;
      out.append(buf, static_cast<std::size_t>(got));
    }
    return out;
  }
  std::optional<std::uint8_t> read_u8(std::chrono::milliseconds within = kWithin) {
    auto b = read(1, within);
    if (!b) return std::nullopt;
    return static_cast<std::uint8_t>((*b)[0]);
  }
  template <class T>
  std::optional<T> read_value(std::chrono::milliseconds within = kWithin) {
    auto b = read(sizeof(T), within);
    if (!b) return std::nullopt;
    T v;
    std::memcpy(&v, b->data(), sizeof v);
    return v;
  }
  std::optional<std::string> read_bytes(std::chrono::milliseconds within = kWithin) {
    auto len = read_value<std::uint64_t>(within);
    if (!len) return std::nullopt;
    return read(static_cast<std::size_t>(*len), within);
  }
  // True when the server closed the connection (EOF or reset) within `within`; replies that
  // arrive first are read and dropped.
  bool closed_by_server(std::chrono::milliseconds within = kWithin) {
    const auto end = std::chrono::steady_clock::now() + within;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          end - std::chrono::steady_clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(0, left.count()))) != 1)
        return false;
      char buf[65536];
      if (::recv(fd_, buf, sizeof buf, MSG_DONTWAIT) <= 0) return true;
    }
  }

  // The queries, each with its reply (nullopt: no reply in time, or the connection closed).
  bool set(const std::string& k, const std::string& v) { return send(req(Op::kSet, {k}, {v})); }
  std::optional<std::string> get(const std::string& k) {
    if (!send(req(Op::kGet, {k}))) return std::nullopt;
    return read_bytes();
  }
  std::optional<std::int64_t> add(const std::string& k, std::int64_t d) {
    Request r = req(Op::kAdd, {k});
    r.delta = d;
    if (!send(r)) return std::nullopt;
    return read_value<std::int64_t>();
  }
  std::optional<bool> check(const std::vector<std::string>& keys) {
    if (!send(req(Op::kCheck, keys))) return std::nullopt;
    auto b = read_u8();
    if (!b) return std::nullopt;
    return *b == rendezvous::tcpstore::kCheckReady;
  }

  static Request req(Op op, std::vector<std::string> keys, std::vector<std::string> values = {}) {
    Request r;
    r.op = op;
    r.keys = std::move(keys);
    r.values = std::move(values);
    return r;
  }

 private:
  Dialect dialect_;
  int fd_ = -1;
};

}  // namespace muster::testing
