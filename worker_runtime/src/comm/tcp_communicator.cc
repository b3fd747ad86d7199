#include "muster/worker/comm/tcp_communicator.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <random>

#include <boost/asio/connect.hpp>
#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "muster/ops/host_id.h"
#include "muster/worker/half.h"

namespace muster::worker {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using unix_stream = asio::local::stream_protocol;
using Socket = asio::generic::stream_protocol::socket;  // a TCP or a Unix-domain stream

constexpr std::uint32_t kMagic = 0x4d555354;  // "MUST"

struct Header {
  std::uint32_t magic, rank, size;
};

template <typename T>
void reduce_into(T* dst, const T* src, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
      break;
    case ReduceOp::kMin:
      for (std::size_t i = 0; i < n; ++i) dst[i] = std::min(dst[i], src[i]);
      break;
    case ReduceOp::kMax:
      for (std::size_t i = 0; i < n; ++i) dst[i] = std::max(dst[i], src[i]);
      break;
  }
}

template <typename T>
void divide(T* data, std::size_t n, int by) {
  for (std::size_t i = 0; i < n; ++i) data[i] /= static_cast<T>(by);
}

// Uneven segments of `count` over `n`: the first count % n get one more element.
struct Segments {
  std::size_t count;
  int n;
  std::size_t start(int i) const {
    return i * (count / n) + std::min<std::size_t>(i, count % n);
  }
  std::size_t len(int i) const { return count / n + (static_cast<std::size_t>(i) < count % n); }
};

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(int rank, int size, TcpOptions opts)
      : rank_(rank), size_(size), opts_(std::move(opts)), send_(io_), recv_(io_), timer_(io_) {}

  ~TcpCommunicator() override { abort(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "tcp"; }

  absl::Status connect(rendezvous::Store& store);
  // connect()'s steps: this rank's connection to the next one (its address from the store),
  // and the previous rank's to this one, accepted within the timeout.
  absl::Status connect_next(rendezvous::Store& store, const std::string& identity,
                            const std::string& uname);
  absl::StatusOr<std::string> next_address(rendezvous::Store& store, int next);
  absl::Status accept_prev(tcp::acceptor& acceptor, unix_stream::acceptor& uacceptor);

  absl::Status all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op,
                          void*) override {
    if (absl::Status s = usable(); !s.ok()) return s;
    switch (dtype) {
      case DType::kF32: return all_reduce_t(static_cast<float*>(data), count, op);
      case DType::kF64: return all_reduce_t(static_cast<double*>(data), count, op);
      case DType::kI32: return all_reduce_t(static_cast<std::int32_t*>(data), count, op);
      case DType::kI64: return all_reduce_t(static_cast<std::int64_t*>(data), count, op);
      case DType::kF16:
      case DType::kBF16: {
        auto* h = static_cast<std::uint16_t*>(data);
        std::vector<float> wide(count);
        widen(h, wide.data(), count, dtype);
        absl::Status s = all_reduce_t(wide.data(), count, op);
        if (s.ok()) narrow(wide.data(), h, count, dtype);
        return s;
      }
    }
    return absl::InvalidArgumentError("tcp communicator: unknown dtype");
  }

  absl::Status broadcast(void* data, std::size_t count, DType dtype, int root, void*) override {
    if (absl::Status s = usable(); !s.ok()) return s;
    if (root < 0 || root >= size_) return absl::InvalidArgumentError("broadcast: bad root");
    // A pipeline along the ring: the root streams the buffer; every other rank forwards each
    // chunk as it lands, except the last before the root.
    char* p = static_cast<char*>(data);
    const std::size_t bytes = count * dtype_size(dtype);
    std::vector<Recv> plan;
    if (rank_ != root) plan.push_back({p, bytes, false, (rank_ + 1) % size_ != root, false});
    return stream(rank_ == root ? p : nullptr, rank_ == root ? bytes : 0, plan, nullptr, nullptr,
                  "broadcast");
  }

  absl::Status all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                          void*) override {
    if (absl::Status s = usable(); !s.ok()) return s;
    const std::size_t block = count * dtype_size(dtype);
    char* out = static_cast<char*>(recv);
    std::memmove(out + rank_ * block, send, block);
    return ring_gather(out, block, "all_gather");
  }

  absl::Status reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                              ReduceOp op, void*) override {
    if (absl::Status s = usable(); !s.ok()) return s;
    const std::size_t total = recv_count * size_;
    switch (dtype) {
      case DType::kF32: return reduce_scatter_t(static_cast<const float*>(send), static_cast<float*>(recv), recv_count, op);
      case DType::kF64: return reduce_scatter_t(static_cast<const double*>(send), static_cast<double*>(recv), recv_count, op);
      case DType::kI32: return reduce_scatter_t(static_cast<const std::int32_t*>(send), static_cast<std::int32_t*>(recv), recv_count, op);
      case DType::kI64: return reduce_scatter_t(static_cast<const std::int64_t*>(send), static_cast<std::int64_t*>(recv), recv_count, op);
      case DType::kF16:
      case DType::kBF16: {
        std::vector<float> wide(total), out(recv_count);
        widen(static_cast<const std::uint16_t*>(send), wide.data(), total, dtype);
        absl::Status s = reduce_scatter_t(wide.data(), out.data(), recv_count, op);
        if (s.ok()) narrow(out.data(), static_cast<std::uint16_t*>(recv), recv_count, dtype);
        return s;
      }
    }
    return absl::InvalidArgumentError("tcp communicator: unknown dtype");
  }

  absl::Status barrier() override {
    if (absl::Status s = usable(); !s.ok()) return s;
    // A ring all-gather of one byte per rank cannot finish on any rank before every rank
    // has entered it.
    std::vector<char> bytes(size_, 1);
    return ring_gather(bytes.data(), 1, "barrier");
  }

  void abort() override {
    if (aborted_.exchange(true)) return;
    // shutdown() is safe from any thread: pending reads and writes fail at once.
    for (Socket* s : {&send_, &recv_}) {
      if (s->is_open()) ::shutdown(s->native_handle(), SHUT_RDWR);
    }
  }

 private:
  // SO_RCVLOWAT, set only when it changes (the last piece of a segment needs a lower mark).
  void set_low_water(std::size_t bytes) {
    const int want = static_cast<int>(bytes);
    if (want == low_water_) return;
    ::setsockopt(recv_.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want);
    low_water_ = want;
  }

  absl::Status usable() const {
    if (aborted_) return absl::CancelledError("tcp communicator: aborted");
    if (!broken_.ok()) return broken_;
    return absl::OkStatus();
  }

  static void widen(const std::uint16_t* h, float* f, std::size_t n, DType t) {
    if (t == DType::kBF16) {
      for (std::size_t i = 0; i < n; ++i) f[i] = bf16_to_f32(h[i]);
    } else {
      for (std::size_t i = 0; i < n; ++i) f[i] = f16_to_f32(h[i]);
    }
  }
  static void narrow(const float* f, std::uint16_t* h, std::size_t n, DType t) {
    if (t == DType::kBF16) {
      for (std::size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(f[i]);
    } else {
      for (std::size_t i = 0; i < n; ++i) h[i] = f32_to_f16(f[i]);
    }
  }

  // One received segment of a ring pipeline.
  struct Recv {
    char* dst;
    std::size_t bytes;
    bool reduce;   // reduce into dst (else the data lands in dst as is)
    bool forward;  // send each chunk on to the next rank once it is final
    bool finish;   // apply `finish` to each chunk before forwarding it (kAvg's division)
  };
  using ChunkFn = std::function<void(char* dst, const char* src, std::size_t bytes)>;

  // The ring as one stream: `first` goes to the next rank at once; the segments of `plan`
  // arrive from the previous rank in order, chunk by chunk, and each chunk is reduced and
  // forwarded as soon as it lands, so every step overlaps the next (the segment a rank
  // receives in one step is the one it sends in the next).
  absl::Status stream(const char* first, std::size_t first_n, const std::vector<Recv>& plan,
                      const ChunkFn& reduce, const ChunkFn& finish, const char* what) {
    if (size_ == 1) return absl::OkStatus();  // no peers: every block is already in place
    std::size_t max_seg = 0;
    for (const Recv& r : plan) {
      if (r.reduce) max_seg = std::max(max_seg, r.bytes);
    }
    if (scratch_.size() < max_seg) scratch_.resize(max_seg);
    // Two chunks per segment (at most chunk_bytes) keep the ring pipelined for mid-sized
    // buffers at few wake-ups: with more ranks than cores, 2 MiB chunks for a 4 MiB segment ran
    // about 8% faster than 1 MiB ones (bench/README.md). A multiple of 64 bytes, so never a
    // split element.
    std::size_t seg_bytes = 0;
    for (const Recv& r : plan) seg_bytes = std::max(seg_bytes, r.bytes);
    const std::size_t chunk =
        std::max<std::size_t>(64, std::clamp<std::size_t>(seg_bytes / 2, 256 * 1024,
                                                          opts_.chunk_bytes) & ~std::size_t{63});
    std::deque<std::pair<const char*, std::size_t>> sendq;
    if (first_n > 0) sendq.emplace_back(first, first_n);
    bool writing = false, timed_out = false;
    boost::system::error_code write_ec, read_ec;
    std::size_t item = 0, got = 0, done = 0;  // receive position within plan[item]
    std::function<void()> write_next = [&] {
      if (writing || sendq.empty() || write_ec) return;
      writing = true;
      auto [ptr, len] = sendq.front();
      send_.async_write_some(asio::buffer(ptr, len),
                             [&](const boost::system::error_code& ec, std::size_t n) {
                               writing = false;
                               if (ec) {
                                 write_ec = ec;
                                 return;
                               }
                               auto& front = sendq.front();
                               front.first += n;
                               front.second -= n;
                               if (front.second == 0) sendq.pop_front();
                               write_next();
                             });
    };
    std::function<void()> read_next = [&] {
      while (item < plan.size() && plan[item].bytes == 0) ++item;
      if (item == plan.size()) return;
      const Recv& r = plan[item];
      char* into = (r.reduce ? scratch_.data() : r.dst) + got;
      if (opts_.recv_low_water > 0) set_low_water(std::min(r.bytes - got, opts_.recv_low_water));
      recv_.async_read_some(asio::buffer(into, r.bytes - got),
                            [&](const boost::system::error_code& ec, std::size_t n) {
                              if (ec) {
                                read_ec = ec;
                                return;
                              }
                              const Recv& cur = plan[item];
                              got += n;
                              while (got - done >= chunk ||
                                     (got == cur.bytes && done < got)) {
                                const std::size_t len = std::min(chunk, got - done);
                                if (cur.reduce) reduce(cur.dst + done, scratch_.data() + done, len);
                                if (cur.finish) finish(cur.dst + done, nullptr, len);
                                if (cur.forward) sendq.emplace_back(cur.dst + done, len);
                                done += len;
                              }
                              write_next();
                              if (got == cur.bytes) {
                                ++item;
                                got = done = 0;
                              }
                              read_next();
                            });
    };
    write_next();
    read_next();
    timer_.expires_after(opts_.timeout);
    timer_.async_wait([&](const boost::system::error_code& ec) {
      if (ec) return;
      timed_out = true;
      shut_sockets();
    });
    io_.restart();
    auto finished = [&] {
      return (item == plan.size() && sendq.empty() && !writing) || write_ec || read_ec ||
             timed_out;
    };
    while (!finished() && io_.run_one() > 0) {
    }
    if (write_ec || read_ec || timed_out) shut_sockets();
    timer_.cancel();
    io_.run();  // drain: the cancelled timer, and ops a failure left pending
    return step_status(write_ec, read_ec, timed_out, what);
  }

  absl::Status step_status(const boost::system::error_code& write_ec,
                           const boost::system::error_code& read_ec, bool timed_out,
                           const char* what) {
    if (!write_ec && !read_ec && !timed_out) return absl::OkStatus();
    const int prev = (rank_ - 1 + size_) % size_, next = (rank_ + 1) % size_;
    if (aborted_) {
      broken_ = absl::CancelledError(absl::StrCat("tcp communicator: ", what, " aborted"));
    } else if (timed_out) {
      broken_ = absl::DeadlineExceededError(absl::StrCat("tcp communicator: rank ", rank_, " ",
                                                         what, " timed out after ",
                                                         opts_.timeout.count(), " ms"));
    } else if (read_ec) {
      broken_ = absl::UnavailableError(absl::StrCat("tcp communicator: rank ", rank_,
                                                    " lost rank ", prev, " during ", what, ": ",
                                                    read_ec.message()));
    } else {
      broken_ = absl::UnavailableError(absl::StrCat("tcp communicator: rank ", rank_,
                                                    " lost rank ", next, " during ", what, ": ",
                                                    write_ec.message()));
    }
    shut_sockets();
    return broken_;
  }

  template <typename T>
  static ChunkFn reducer(ReduceOp op) {
    return [op](char* dst, const char* src, std::size_t bytes) {
      reduce_into(reinterpret_cast<T*>(dst), reinterpret_cast<const T*>(src), bytes / sizeof(T), op);
    };
  }
  template <typename T>
  ChunkFn averager() const {
    const int n = size_;
    return [n](char* dst, const char*, std::size_t bytes) {
      divide(reinterpret_cast<T*>(dst), bytes / sizeof(T), n);
    };
  }

  // Reduce-scatter steps: at step s rank r receives segment (r - s - 2) mod n and reduces it;
  // after n - 1 steps segment r is complete here. `then_gather` forwards segment r too, which
  // starts the all-gather.
  template <typename T>
  void plan_reduce_scatter(T* data, const Segments& seg, bool avg, bool then_gather,
                           std::vector<Recv>& plan) const {
    const int n = size_;
    for (int s = 0; s < n - 1; ++s) {
      const int in = (rank_ - s + 2 * n - 2) % n;
      const bool last = s == n - 2;
      plan.push_back({reinterpret_cast<char*>(data + seg.start(in)), seg.len(in) * sizeof(T),
                      true, !last || then_gather, last && avg});
    }
  }
  // All-gather steps: rank r holds segment r; at step s it receives segment (r - s - 1) mod n.
  template <typename T>
  void plan_all_gather(T* data, const Segments& seg, std::vector<Recv>& plan) const {
    const int n = size_;
    for (int s = 0; s < n - 1; ++s) {
      const int in = (rank_ - s - 1 + n) % n;
      plan.push_back({reinterpret_cast<char*>(data + seg.start(in)), seg.len(in) * sizeof(T),
                      false, s < n - 2, false});
    }
  }

  absl::Status ring_gather(char* blocks, std::size_t block_bytes, const char* what) {
    Segments seg{block_bytes * size_, size_};
    std::vector<Recv> plan;
    plan_all_gather(blocks, seg, plan);
    return stream(blocks + seg.start(rank_), seg.len(rank_), plan, nullptr, nullptr, what);
  }

  template <typename T>
  absl::Status all_reduce_t(T* data, std::size_t count, ReduceOp op) {
    if (size_ == 1) return absl::OkStatus();
    Segments seg{count, size_};
    std::vector<Recv> plan;
    plan_reduce_scatter(data, seg, op == ReduceOp::kAvg, true, plan);
    plan_all_gather(data, seg, plan);
    const int first = (rank_ - 1 + size_) % size_;
    return stream(reinterpret_cast<const char*>(data + seg.start(first)),
                  seg.len(first) * sizeof(T), plan, reducer<T>(op), averager<T>(), "all_reduce");
  }

  template <typename T>
  absl::Status reduce_scatter_t(const T* send, T* recv, std::size_t recv_count, ReduceOp op) {
    Segments seg{recv_count * size_, size_};
    work_.resize(recv_count * size_ * sizeof(T));
    T* work = reinterpret_cast<T*>(work_.data());
    std::memcpy(work, send, work_.size());
    if (size_ > 1) {
      std::vector<Recv> plan;
      plan_reduce_scatter(work, seg, false, false, plan);
      const int first = (rank_ - 1 + size_) % size_;
      absl::Status s = stream(reinterpret_cast<const char*>(work + seg.start(first)),
                              seg.len(first) * sizeof(T), plan, reducer<T>(op), nullptr,
                              "reduce_scatter");
      if (!s.ok()) return s;
    }
    if (op == ReduceOp::kAvg) divide(work + seg.start(rank_), recv_count, size_);
    std::memcpy(recv, work + seg.start(rank_), recv_count * sizeof(T));
    return absl::OkStatus();
  }

  void shut_sockets() {
    for (Socket* s : {&send_, &recv_}) {
      if (s->is_open()) ::shutdown(s->native_handle(), SHUT_RDWR);
    }
  }

  const int rank_, size_;
  TcpOptions opts_;
  asio::io_context io_;
  Socket send_;  // to rank_ + 1
  Socket recv_;  // from rank_ - 1
  asio::steady_timer timer_;
  std::atomic<bool> aborted_{false};
  absl::Status broken_;
  std::vector<char> scratch_, work_;
  int low_water_ = 1;  // the socket's SO_RCVLOWAT (1: the default)
};

// Every rank listens on TCP and, when same_host_unix is set, on an abstract Unix-domain name,
// and publishes "tcp/<rank>" = "host:port|host-identity|unix-name". A rank connects to the
// next one over the Unix socket when both have the same host identity (machine boot and network
// namespace; falling back to TCP if that connect fails), else over TCP; it accepts either.
absl::Status TcpCommunicator::connect(rendezvous::Store& store) {
  if (size_ == 1) return absl::OkStatus();
  boost::system::error_code ec;
  tcp::acceptor acceptor(io_);
  tcp::endpoint local(asio::ip::make_address(opts_.listen_host, ec), 0);
  if (ec) return absl::InvalidArgumentError("tcp communicator: bad listen address " + opts_.listen_host);
  acceptor.open(local.protocol(), ec);
  if (!ec) acceptor.bind(local, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return absl::UnavailableError("tcp communicator: cannot listen: " + ec.message());
  unix_stream::acceptor uacceptor(io_);
  std::string uname;  // without the leading NUL of the abstract namespace
  const std::string identity = opts_.same_host_unix ? ops::host_identity() : std::string();
  if (!identity.empty()) {
    uname = absl::StrCat("muster-ring-", ::getpid(), "-", std::random_device{}());
    boost::system::error_code uec;
    uacceptor.open(unix_stream(), uec);
    if (!uec) uacceptor.bind(unix_stream::endpoint(std::string(1, '\0') + uname), uec);
    if (!uec) uacceptor.listen(asio::socket_base::max_listen_connections, uec);
    if (uec) uname.clear();  // TCP only
  }
  // "host:port|identity|unix-name" (the identity holds a space).
  const std::string me = absl::StrCat(opts_.advertise_host, ":", acceptor.local_endpoint().port(),
                                      "|", identity.empty() ? "-" : identity, "|", uname.empty() ? "-" : uname);
  if (absl::Status s = store.set(absl::StrCat("tcp/", rank_), me); !s.ok()) return s;
  if (absl::Status s = connect_next(store, identity, uname); !s.ok()) return s;
  if (absl::Status s = accept_prev(acceptor, uacceptor); !s.ok()) return s;
  // Buffer sizes are left to the kernel's autotuning (setting them turns it off).
  return absl::OkStatus();
}

// The next rank's address, waited for within the timeout; in slices when set-up can be
// cancelled.
absl::StatusOr<std::string> TcpCommunicator::next_address(rendezvous::Store& store, int next) {
  const std::string key = absl::StrCat("tcp/", next);
  if (!opts_.cancelled) return store.get(key, opts_.timeout);
  const auto until = std::chrono::steady_clock::now() + opts_.timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    auto addr = store.get(key, std::clamp(left, std::chrono::milliseconds(1), kSetupPollSlice));
    if (addr.ok() || addr.status().code() != absl::StatusCode::kDeadlineExceeded) return addr;
    if (opts_.cancelled()) return absl::CancelledError("set-up cancelled: the world changed");
    if (left <= kSetupPollSlice) return addr;
  }
}

absl::Status TcpCommunicator::connect_next(rendezvous::Store& store, const std::string& identity,
                                           const std::string& uname) {
  const int next = (rank_ + 1) % size_;
  boost::system::error_code ec;
  absl::StatusOr<std::string> addr = next_address(store, next);
  if (!addr.ok()) {
    return absl::Status(addr.status().code(),
                        absl::StrCat("tcp communicator: address of rank ", next, ": ",
                                     addr.status().message()));
  }
  std::vector<std::string> parts;
  for (std::size_t at = 0; at <= addr->size();) {
    const std::size_t sp = std::min(addr->find('|', at), addr->size());
    parts.push_back(addr->substr(at, sp - at));
    at = sp + 1;
  }
  const std::string& hostport = parts[0];
  if (!uname.empty() && parts.size() == 3 && parts[1] == identity && parts[2] != "-") {
    unix_stream::socket us(io_);
    boost::system::error_code uec;
    us.connect(unix_stream::endpoint(std::string(1, '\0') + parts[2]), uec);
    if (!uec) send_.assign(asio::generic::stream_protocol(AF_UNIX, 0), us.release(), uec);
  }
  if (!send_.is_open()) {
    auto colon = hostport.rfind(':');
    tcp::resolver resolver(io_);
    auto endpoints = resolver.resolve(hostport.substr(0, colon), hostport.substr(colon + 1), ec);
    tcp::socket ts(io_);
    if (!ec) asio::connect(ts, endpoints, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("tcp communicator: cannot connect to rank ", next, " at ", hostport, ": ",
                       ec.message()));
    }
    ts.set_option(tcp::no_delay(true), ec);
    const int family = ts.local_endpoint(ec).protocol().family();
    send_.assign(asio::generic::stream_protocol(family, IPPROTO_TCP), ts.release(), ec);
  }
  Header out{kMagic, static_cast<std::uint32_t>(rank_), static_cast<std::uint32_t>(size_)};
  asio::write(send_, asio::buffer(&out, sizeof out), ec);
  return absl::OkStatus();
}

absl::Status TcpCommunicator::accept_prev(tcp::acceptor& acceptor,
                                          unix_stream::acceptor& uacceptor) {
  const int prev = (rank_ - 1 + size_) % size_;
  boost::system::error_code ec;
  // Accept the previous rank on either listener, bounded by the timeout.
  bool accepted = false, timed_out = false;
  boost::system::error_code accept_ec;
  tcp::socket tin(io_);
  unix_stream::socket uin(io_);
  acceptor.async_accept(tin, [&](const boost::system::error_code& e) {
    if (accepted || e == asio::error::operation_aborted) return;
    accepted = true;
    accept_ec = e;
    if (e) return;
    tin.set_option(tcp::no_delay(true), accept_ec);
    const int family = tin.local_endpoint(accept_ec).protocol().family();
    if (!accept_ec) recv_.assign(asio::generic::stream_protocol(family, IPPROTO_TCP), tin.release(), accept_ec);
  });
  if (uacceptor.is_open()) {
    uacceptor.async_accept(uin, [&](const boost::system::error_code& e) {
      if (accepted || e == asio::error::operation_aborted) return;
      accepted = true;
      accept_ec = e;
      if (!e) recv_.assign(asio::generic::stream_protocol(AF_UNIX, 0), uin.release(), accept_ec);
    });
  }
  timer_.expires_after(opts_.timeout);
  timer_.async_wait([&](const boost::system::error_code& e) {
    if (e) return;
    timed_out = true;
  });
  io_.restart();
  bool cancelled = false;
  while (!accepted && !timed_out) {
    if (!opts_.cancelled) {
      if (io_.run_one() == 0) break;
      continue;
    }
    io_.run_one_for(kSetupPollSlice);
    if (!accepted && opts_.cancelled()) {
      cancelled = true;
      break;
    }
  }
  timer_.cancel();
  acceptor.close(ec);
  uacceptor.close(ec);
  io_.run();
  if (cancelled && !accepted) return absl::CancelledError("set-up cancelled: the world changed");
  if (!accepted || accept_ec) {
    return absl::DeadlineExceededError(absl::StrCat("tcp communicator: rank ", prev,
                                                    " did not connect within the timeout"));
  }
  Header in{};
  asio::read(recv_, asio::buffer(&in, sizeof in), ec);
  if (ec || in.magic != kMagic || static_cast<int>(in.rank) != prev ||
      static_cast<int>(in.size) != size_) {
    return absl::DataLossError("tcp communicator: bad handshake from the previous rank");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> make_tcp_communicator(rendezvous::Store& store,
                                                                    int rank, int size,
                                                                    const TcpOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError("tcp communicator: rank must be in [0, size)");
  }
  auto comm = std::make_unique<TcpCommunicator>(rank, size, options);
  if (absl::Status s = comm->connect(store); !s.ok()) return s;
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace muster::worker
