#include "muster/worker/comm/tcp_communicator.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "muster/worker/half.h"

namespace muster::worker {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

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
    if (size_ == 1) return absl::OkStatus();
    char* p = static_cast<char*>(data);
    const std::size_t bytes = count * dtype_size(dtype);
    const std::size_t chunk = opts_.chunk_bytes;
    const std::size_t chunks = (bytes + chunk - 1) / chunk;
    const bool is_root = rank_ == root;
    const bool forwards = (rank_ + 1) % size_ != root;
    // Pipeline: at step c, forward chunk c-1 while receiving chunk c.
    for (std::size_t c = 0; c <= chunks; ++c) {
      auto range = [&](std::size_t i) {
        std::size_t off = i * chunk;
        return std::make_pair(p + off, std::min(chunk, bytes - off));
      };
      const char* send = nullptr;
      std::size_t send_n = 0;
      char* recv = nullptr;
      std::size_t recv_n = 0;
      if (is_root) {
        if (c < chunks) std::tie(send, send_n) = range(c);
      } else {
        if (forwards && c > 0) std::tie(send, send_n) = range(c - 1);
        if (c < chunks) {
          auto r = range(c);
          recv = r.first;
          recv_n = r.second;
        }
      }
      if (absl::Status s = exchange(send, send_n, recv, recv_n, nullptr, "broadcast"); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
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
    for (tcp::socket* s : {&send_, &recv_}) {
      if (s->is_open()) ::shutdown(s->native_handle(), SHUT_RDWR);
    }
  }

 private:
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

  // Ring reduce-scatter over `seg` of `data`; afterwards segment rank_ is fully reduced.
  template <typename T>
  absl::Status ring_reduce_scatter(T* data, const Segments& seg, ReduceOp op, const char* what) {
    const int n = size_;
    std::size_t max_len = 0;
    for (int i = 0; i < n; ++i) max_len = std::max(max_len, seg.len(i));
    scratch_.resize(max_len * sizeof(T));
    for (int s = 0; s < n - 1; ++s) {
      const int out = (rank_ - s + 2 * n - 1) % n;
      const int in = (rank_ - s + 2 * n - 2) % n;
      T* dst = data + seg.start(in);
      auto reduce = [&](std::size_t off, std::size_t bytes) {
        reduce_into(dst + off / sizeof(T), reinterpret_cast<const T*>(scratch_.data() + off),
                    bytes / sizeof(T), op);
      };
      absl::Status st = exchange(reinterpret_cast<const char*>(data + seg.start(out)),
                                 seg.len(out) * sizeof(T), scratch_.data(), seg.len(in) * sizeof(T),
                                 reduce, what);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // Ring all-gather where rank i's block is segment i of `data`.
  template <typename T>
  absl::Status ring_all_gather(T* data, const Segments& seg, const char* what) {
    const int n = size_;
    for (int s = 0; s < n - 1; ++s) {
      const int out = (rank_ - s + n) % n;
      const int in = (rank_ - s - 1 + n) % n;
      absl::Status st = exchange(reinterpret_cast<const char*>(data + seg.start(out)),
                                 seg.len(out) * sizeof(T),
                                 reinterpret_cast<char*>(data + seg.start(in)),
                                 seg.len(in) * sizeof(T), nullptr, what);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  absl::Status ring_gather(char* blocks, std::size_t block_bytes, const char* what) {
    return ring_all_gather(blocks, Segments{block_bytes * size_, size_}, what);
  }

  template <typename T>
  absl::Status all_reduce_t(T* data, std::size_t count, ReduceOp op) {
    if (size_ > 1) {
      Segments seg{count, size_};
      if (absl::Status s = ring_reduce_scatter(data, seg, op, "all_reduce"); !s.ok()) return s;
      if (op == ReduceOp::kAvg) divide(data + seg.start(rank_), seg.len(rank_), size_);
      return ring_all_gather(data, seg, "all_reduce");
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status reduce_scatter_t(const T* send, T* recv, std::size_t recv_count, ReduceOp op) {
    Segments seg{recv_count * size_, size_};
    work_.resize(recv_count * size_ * sizeof(T));
    T* work = reinterpret_cast<T*>(work_.data());
    std::memcpy(work, send, work_.size());
    if (size_ > 1) {
      if (absl::Status s = ring_reduce_scatter(work, seg, op, "reduce_scatter"); !s.ok()) return s;
    }
    if (op == ReduceOp::kAvg) divide(work + seg.start(rank_), recv_count, size_);
    std::memcpy(recv, work + seg.start(rank_), recv_count * sizeof(T));
    return absl::OkStatus();
  }

  // One ring step: writes `send` to the next rank while reading `recv` from the previous one
  // in chunks, calling on_chunk(offset, bytes) as each lands. Bounded by the timeout; any
  // failure breaks the communicator and shuts its sockets so the neighbours fail too.
  absl::Status exchange(const char* send, std::size_t send_n, char* recv, std::size_t recv_n,
                        const std::function<void(std::size_t, std::size_t)>& on_chunk,
                        const char* what) {
    if (send_n == 0 && recv_n == 0) return absl::OkStatus();
    boost::system::error_code write_ec, read_ec;
    bool write_done = send_n == 0, read_done = recv_n == 0, timed_out = false;
    if (!write_done) {
      asio::async_write(send_, asio::buffer(send, send_n),
                        [&](const boost::system::error_code& ec, std::size_t) {
                          write_ec = ec;
                          write_done = true;
                        });
    }
    std::size_t got = 0;
    std::function<void()> read_next = [&] {
      const std::size_t n = std::min(opts_.chunk_bytes, recv_n - got);
      asio::async_read(recv_, asio::buffer(recv + got, n),
                       [&, n](const boost::system::error_code& ec, std::size_t) {
                         if (ec) {
                           read_ec = ec;
                           read_done = true;
                           return;
                         }
                         if (on_chunk) on_chunk(got, n);
                         got += n;
                         if (got == recv_n) read_done = true;
                         else read_next();
                       });
    };
    if (!read_done) read_next();
    timer_.expires_after(opts_.timeout);
    timer_.async_wait([&](const boost::system::error_code& ec) {
      if (ec) return;
      timed_out = true;
      shut_sockets();
    });
    io_.restart();
    while (!(write_done && read_done) && io_.run_one() > 0) {
      if ((write_ec || read_ec) && !(write_done && read_done)) shut_sockets();
    }
    timer_.cancel();
    io_.run();  // drain the cancelled timer (and anything a failure left pending)
    if (!write_ec && !read_ec && !timed_out) return absl::OkStatus();
    const int prev = (rank_ - 1 + size_) % size_, next = (rank_ + 1) % size_;
    if (aborted_) {
      broken_ = absl::CancelledError(absl::StrCat("tcp communicator: ", what, " aborted"));
    } else if (timed_out) {
      broken_ = absl::DeadlineExceededError(absl::StrCat(
          "tcp communicator: rank ", rank_, " ", what, " timed out after ",
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

  void shut_sockets() {
    for (tcp::socket* s : {&send_, &recv_}) {
      if (s->is_open()) ::shutdown(s->native_handle(), SHUT_RDWR);
    }
  }

  const int rank_, size_;
  TcpOptions opts_;
  asio::io_context io_;
  tcp::socket send_;  // to rank_ + 1
  tcp::socket recv_;  // from rank_ - 1
  asio::steady_timer timer_;
  std::atomic<bool> aborted_{false};
  absl::Status broken_;
  std::vector<char> scratch_, work_;
};

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
  const std::string me =
      absl::StrCat(opts_.advertise_host, ":", acceptor.local_endpoint().port());
  if (absl::Status s = store.set(absl::StrCat("tcp/", rank_), me); !s.ok()) return s;
  const int next = (rank_ + 1) % size_, prev = (rank_ - 1 + size_) % size_;
  auto addr = store.get(absl::StrCat("tcp/", next), opts_.timeout);
  if (!addr.ok()) {
    return absl::Status(addr.status().code(),
                        absl::StrCat("tcp communicator: address of rank ", next, ": ",
                                     addr.status().message()));
  }
  auto colon = addr->rfind(':');
  tcp::resolver resolver(io_);
  auto endpoints = resolver.resolve(addr->substr(0, colon), addr->substr(colon + 1), ec);
  if (!ec) asio::connect(send_, endpoints, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("tcp communicator: cannot connect to rank ", next, " at ", *addr, ": ",
                     ec.message()));
  }
  Header out{kMagic, static_cast<std::uint32_t>(rank_), static_cast<std::uint32_t>(size_)};
  asio::write(send_, asio::buffer(&out, sizeof out), ec);
  // Accept the previous rank, bounded by the timeout.
  bool accepted = false, timed_out = false;
  boost::system::error_code accept_ec;
  acceptor.async_accept(recv_, [&](const boost::system::error_code& e) {
    accept_ec = e;
    accepted = true;
  });
  timer_.expires_after(opts_.timeout);
  timer_.async_wait([&](const boost::system::error_code& e) {
    if (e) return;
    timed_out = true;
    acceptor.cancel();
  });
  io_.restart();
  while (!accepted && io_.run_one() > 0) {
  }
  timer_.cancel();
  io_.run();
  if (timed_out || accept_ec) {
    return absl::DeadlineExceededError(absl::StrCat("tcp communicator: rank ", prev,
                                                    " did not connect within the timeout"));
  }
  Header in{};
  asio::read(recv_, asio::buffer(&in, sizeof in), ec);
  if (ec || in.magic != kMagic || static_cast<int>(in.rank) != prev ||
      static_cast<int>(in.size) != size_) {
    return absl::DataLossError("tcp communicator: bad handshake from the previous rank");
  }
  for (tcp::socket* s : {&send_, &recv_}) {
    s->set_option(tcp::no_delay(true), ec);
    s->set_option(asio::socket_base::send_buffer_size(4 << 20), ec);
    s->set_option(asio::socket_base::receive_buffer_size(4 << 20), ec);
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
