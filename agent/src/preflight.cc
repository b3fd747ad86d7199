#include "muster/agent/preflight.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/ops/median.h"
#include "muster/rendezvous/prefix_store.h"

namespace muster::agent::preflight {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

constexpr char kMagic[4] = {'M', 'P', 'F', '1'};
// Small socket buffers: what a sender has queued when its time is up is drained within the
// measure, and a slow link's drain stays short.
constexpr int kSocketBuffer = 256 * 1024;
constexpr std::size_t kChunk = 64 * 1024;

// The median of the measures that gave a number (a probe that failed gave 0).
double median_of_measured(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !(x > 0); }), v.end());
  return median(std::move(v));
}

absl::Status errno_status(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Writes all of `n` bytes before `deadline`.
bool write_all(int fd, const void* p, std::size_t n, Clock::time_point deadline) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLOUT, 0};
    if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) return false;
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    c += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, std::size_t n, Clock::time_point deadline) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) return false;
    const ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

// Sends for `d` (as fast as the link takes it), then closes the sending side.
bool send_for(int fd, milliseconds d, Clock::time_point deadline) {
  static const std::string chunk(kChunk, 'x');
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
    pollfd pfd{fd, POLLOUT, 0};
    const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
    if (::poll(&pfd, 1, static_cast<int>(std::max<std::int64_t>(left, 1))) < 0 && errno != EINTR) {
      return false;
    }
    if (!(pfd.revents & POLLOUT)) continue;
    const ssize_t w = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno != EAGAIN && errno != EINTR) return false;
  }
  ::shutdown(fd, SHUT_WR);
  return Clock::now() < deadline;
}

// Receives until the peer closes its side: bytes and the time from the first byte to the end.
bool receive_all(int fd, std::uint64_t& bytes, std::uint64_t& ns, Clock::time_point deadline) {
  std::vector<char> buf(kChunk);
  bytes = 0;
  Clock::time_point first{};
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) return false;
    const ssize_t r = ::recv(fd, buf.data(), buf.size(), 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r < 0) return false;
    if (r == 0) break;
    if (bytes == 0) first = Clock::now();
    bytes += static_cast<std::uint64_t>(r);
  }
  ns = bytes == 0 ? 0
                  : static_cast<std::uint64_t>(
                        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - first)
                            .count());
  return true;
}

void tune(int fd) {
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof(kSocketBuffer));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &kSocketBuffer, sizeof(kSocketBuffer));
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

double mbps(std::uint64_t bytes, std::uint64_t ns) {
  return ns == 0 ? 0 : static_cast<double>(bytes) / 1e6 / (static_cast<double>(ns) / 1e9);
}

// One probe connection, server side.
void serve_one(int fd) {
  const auto deadline = Clock::now() + kConnectionLimit;
  tune(fd);
  char magic[4];
  std::uint32_t ms = 0;
  if (read_all(fd, magic, 4, deadline) && std::memcmp(magic, kMagic, 4) == 0 &&
      read_all(fd, &ms, 4, deadline) && ms > 0 && ms <= 5000) {
    std::uint64_t got[2] = {0, 0};
    if (receive_all(fd, got[0], got[1], deadline) && write_all(fd, got, sizeof(got), deadline)) {
      send_for(fd, milliseconds(ms), deadline);
      // Wait for the client's close: the data is then all read, not reset by ours.
      char c;
      pollfd pfd{fd, POLLIN, 0};
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      if (left > 0 && ::poll(&pfd, 1, static_cast<int>(left)) > 0) (void)::recv(fd, &c, 1, 0);
    }
  }
  ::close(fd);
}

absl::StatusOr<addrinfo*> resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("pre-flight: cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  return res;
}

std::string key(const std::string& what, int i) { return absl::StrCat("preflight/", what, "/", i); }

// A barrier of `n` nodes on `name`: each adds one, the last one sets the done key.
absl::Status barrier(rendezvous::Store& store, const std::string& name, int n, milliseconds wait) {
  auto count = store.add(absl::StrCat("preflight/", name, "/count"), 1);
  if (!count.ok()) return count.status();
  const std::string done = absl::StrCat("preflight/", name, "/done");
  if (*count == n) {
    if (absl::Status st = store.set(done, "1"); !st.ok()) return st;
  }
  return store.wait({done}, wait);
}

}  // namespace

std::vector<std::vector<Edge>> schedule(int n) {
  std::vector<std::vector<Edge>> rounds;
  if (n < 2) return rounds;
  if (n == 2) return {{Edge{0, 1}}};
  // Ring edges i -> i+1: the even ones, then the odd ones; when n is odd the last edge (n-1 ->
  // 0) shares a node with the first of both, so it goes alone in a third round.
  std::vector<Edge> even, odd, last;
  for (int i = 0; i < n; ++i) {
    const Edge e{i, (i + 1) % n};
    if (n % 2 == 1 && i == n - 1) {
      last.push_back(e);
    } else {
      (i % 2 == 0 ? even : odd).push_back(e);
    }
  }
  for (auto* r : {&even, &odd, &last}) {
    if (!r->empty()) rounds.push_back(*r);
  }
  return rounds;
}

bool Verdict::named(int node) const {
  return std::binary_search(slow_link.begin(), slow_link.end(), node) ||
         std::binary_search(slow_compute.begin(), slow_compute.end(), node);
}

std::string Verdict::why(int node) const {
  std::string out;
  if (std::binary_search(slow_link.begin(), slow_link.end(), node)) {
    out = absl::StrFormat("its link moved %.1f MB/s at best, the nodes' median is %.1f MB/s",
                          link[static_cast<std::size_t>(node)], link_median);
  }
  if (std::binary_search(slow_compute.begin(), slow_compute.end(), node)) {
    absl::StrAppend(&out, out.empty() ? "" : "; ",
                    absl::StrFormat("its compute scored %.0f, the nodes' median is %.0f",
                                    compute[static_cast<std::size_t>(node)], compute_median));
  }
  return out;
}

Verdict judge(int n, const std::vector<Measured>& probes, const std::vector<double>& compute,
              double ratio) {
  Verdict v;
  v.link.assign(static_cast<std::size_t>(std::max(n, 0)), 0);
  v.compute = compute;
  v.compute.resize(v.link.size(), 0);
  for (const Measured& m : probes) {
    for (int node : {m.edge.from, m.edge.to}) {
      if (node < 0 || node >= n) continue;
      double& best = v.link[static_cast<std::size_t>(node)];
      best = std::max(best, m.mbps);
    }
  }
  v.link_median = median_of_measured(v.link);
  v.compute_median = median_of_measured(v.compute);
  if (n < 3) return v;  // two nodes cannot tell which of them is slow
  for (int i = 0; i < n; ++i) {
    const double l = v.link[static_cast<std::size_t>(i)];
    if (l > 0 && v.link_median > 0 && l < ratio * v.link_median) v.slow_link.push_back(i);
    const double c = v.compute[static_cast<std::size_t>(i)];
    if (c > 0 && v.compute_median > 0 && c < ratio * v.compute_median) {
      v.slow_compute.push_back(i);
    }
  }
  return v;
}

double compute_score(milliseconds d) {
  // 4,096 floats (16 KB: in any L1), multiply-added in place; volatile keeps the work.
  std::vector<float> a(4096, 1.0001f), b(4096, 0.9999f);
  std::uint64_t ops = 0;
  const auto start = Clock::now();
  const auto until = start + d;
  while (Clock::now() < until) {
    for (int rep = 0; rep < 64; ++rep) {
      for (std::size_t i = 0; i < a.size(); ++i) a[i] = a[i] * b[i] + 1e-7f;
    }
    ops += 64 * a.size();
  }
  volatile float sink = a[17];
  (void)sink;
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  return s > 0 ? static_cast<double>(ops) / s / 1e6 : 0;
}

absl::StatusOr<std::unique_ptr<ProbeServer>> ProbeServer::start(const std::string& host) {
  auto res = resolve(host, 0, true);
  if (!res.ok()) return res.status();
  std::unique_ptr<ProbeServer> s(new ProbeServer());
  for (addrinfo* ai = *res; ai != nullptr && s->fd_ < 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      s->fd_ = fd;
    } else {
      ::close(fd);
    }
  }
  ::freeaddrinfo(*res);
  if (s->fd_ < 0) return errno_status(absl::StrCat("pre-flight: listen on ", host));
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(s->fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (::pipe2(s->wake_, O_CLOEXEC) != 0) return errno_status("pre-flight: pipe");
  s->accept_ = std::thread([p = s.get()] { p->serve(); });
  return s;
}

void ProbeServer::serve() {
  std::list<std::thread> conns;
  auto busy = std::make_shared<std::atomic<int>>(0);
  while (true) {
    pollfd pfds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(pfds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pfds[1].revents) break;
    if (!(pfds[0].revents & POLLIN)) continue;
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    if (busy->load() >= kMaxProbeConnections ||
        static_cast<int>(conns.size()) >= kMaxProbeConnectionsServed) {
      ::close(c);  // more than the pre-flight can ask: refused
      continue;
    }
    ++*busy;
    conns.emplace_back([c, busy] {
      serve_one(c);
      --*busy;
    });
  }
  // Each connection ends within kConnectionLimit.
  for (std::thread& t : conns) t.join();
}

ProbeServer::~ProbeServer() {
  if (wake_[1] >= 0) {
    const char b = 1;
    (void)!::write(wake_[1], &b, 1);
  }
  if (accept_.joinable()) accept_.join();
  for (int fd : {fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

absl::StatusOr<double> probe(const std::string& host, int port, milliseconds d) {
  auto res = resolve(host, port, false);
  if (!res.ok()) return res.status();
  int fd = -1;
  for (addrinfo* ai = *res; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    tune(fd);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(*res);
  if (fd < 0) return errno_status(absl::StrCat("pre-flight: connect to ", host, ":", port));
  const auto deadline = Clock::now() + kConnectionLimit;
  const std::uint32_t ms = static_cast<std::uint32_t>(d.count());
  std::uint64_t sent[2] = {0, 0}, got[2] = {0, 0};
  const bool ok = write_all(fd, kMagic, 4, deadline) && write_all(fd, &ms, 4, deadline) &&
                  send_for(fd, d, deadline) && read_all(fd, sent, sizeof(sent), deadline) &&
                  receive_all(fd, got[0], got[1], deadline);
  ::close(fd);
  if (!ok) {
    return absl::UnavailableError(
        absl::StrCat("pre-flight: the probe of ", host, ":", port, " did not complete"));
  }
  return std::min(mbps(sent[0], sent[1]), mbps(got[0], got[1]));
}

absl::StatusOr<Verdict> run(const Options& o) {
  rendezvous::Store& store = *o.store;
  const int n = o.nodes;
  auto server = ProbeServer::start(o.host);
  if (!server.ok()) return server.status();
  if (absl::Status st = store.set(key("host", o.node), o.host); !st.ok()) return st;
  if (absl::Status st = store.set(key("addr", o.node), absl::StrCat((*server)->port()));
      !st.ok()) {
    return st;
  }
  // Every node's kernel at once, after a barrier: nodes that share a machine (tests, a
  // busy host) then share it alike, and the other agents' start-up does not land on one.
  if (absl::Status st = barrier(store, "compute", n, o.wait); !st.ok()) return st;
  const double compute = compute_score(o.compute_time);
  if (absl::Status st = store.set(key("compute", o.node), absl::StrFormat("%.3f", compute));
      !st.ok()) {
    return st;
  }
  const auto rounds = schedule(n);
  int k = 0;
  for (const auto& round : rounds) {
    if (absl::Status st = barrier(store, absl::StrCat("round", k), n, o.wait); !st.ok()) return st;
    for (const Edge& e : round) {
      if (e.from != o.node) continue;
      auto addr = store.get(key("addr", e.to), o.wait);
      if (!addr.ok()) return addr.status();
      auto host = store.get(key("host", e.to), o.wait);
      if (!host.ok()) return host.status();
      int port = 0;
      if (!absl::SimpleAtoi(*addr, &port)) {
        return absl::InvalidArgumentError(absl::StrCat("pre-flight: bad address '", *addr, "'"));
      }
      auto rate = probe(*host, port, o.probe_time);
      if (!rate.ok()) return rate.status();
      if (absl::Status st = store.set(key("link", e.from), absl::StrFormat("%.3f", *rate));
          !st.ok()) {
        return st;
      }
    }
    ++k;
  }
  if (absl::Status st = barrier(store, "end", n, o.wait); !st.ok()) return st;
  std::vector<std::string> keys;
  std::vector<Edge> edges;
  for (const auto& round : rounds) {
    for (const Edge& e : round) {
      edges.push_back(e);
      keys.push_back(key("link", e.from));
    }
  }
  for (int i = 0; i < n; ++i) keys.push_back(key("compute", i));
  auto values = store.multi_get(keys, o.wait);
  if (!values.ok()) return values.status();
  std::vector<Measured> probes;
  for (std::size_t i = 0; i < edges.size(); ++i) {
    double r = 0;
    (void)absl::SimpleAtod((*values)[i], &r);
    probes.push_back(Measured{edges[i], r});
  }
  std::vector<double> scores;
  for (int i = 0; i < n; ++i) {
    double c = 0;
    (void)absl::SimpleAtod((*values)[edges.size() + static_cast<std::size_t>(i)], &c);
    scores.push_back(c);
  }
  return judge(n, probes, scores, o.ratio);
}

Background::Background(rendezvous::GrpcStoreOptions store, std::string prefix, Options o,
                       std::function<void(absl::StatusOr<Verdict>)> done)
    : thread_([store = std::move(store), prefix = std::move(prefix), o,
               done = std::move(done)]() mutable {
        rendezvous::GrpcStore grpc(std::move(store));
        rendezvous::PrefixStore prefixed(prefix, grpc);
        o.store = &prefixed;
        done(run(o));
      }) {}

Background::~Background() {
  if (thread_.joinable()) thread_.join();
}

}  // namespace muster::agent::preflight
