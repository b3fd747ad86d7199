// fault_proxy: a user-space TCP proxy with faults, for tests on machines without netem.
//
//   fault_proxy --listen ADDR:PORT --target HOST:PORT [--delay_ms N] [--rate_kbit N]
//               [--port_file F]
//
// Accepts connections on ADDR:PORT (PORT 0: the kernel picks one) and connects each to
// HOST:PORT. Once listening it writes the bound port to F (atomically: written aside, renamed)
// and prints "listening on PORT" on stdout.
//
// Every byte is forwarded in order, both directions. A chunk read at time t is delivered no
// earlier than t + delay_ms (a one-way delay per direction: chunks are queued with their due
// time, so a stream is delayed, not serialised into per-chunk sleeps; a request/response pays it
// twice). --rate_kbit caps each direction of each connection (token bucket, 20 ms burst).
// EOF is forwarded as a half close once the queue before it is delivered; a reset or error on
// one side closes both.
//
// Signals: SIGUSR1 turns on a black hole: nothing is read, written or accepted, connections stay
// open (no FIN, no RST), queued bytes wait. SIGUSR2 turns it off. Each prints "blackhole on" or
// "blackhole off" on stdout once in effect. SIGTERM/SIGINT end the proxy (exit 0).
//
// One thread, poll(2) and a signalfd. Memory is bounded: a side is not read while its queue
// holds 4 MiB or more.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <list>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kQueueCap = 4 << 20;
constexpr std::size_t kReadSize = 64 << 10;

struct Options {
  std::string listen, target, port_file;
  int delay_ms = 0;
  int rate_kbit = 0;
};

struct Chunk {
  Clock::time_point due;
  std::string data;
  std::size_t off = 0;
};

// One direction of a connection: bytes read from `from`, queued, written to `to`.
struct Dir {
  int from = -1, to = -1;
  std::deque<Chunk> q;
  std::size_t queued = 0;
  bool eof = false;   // `from` said EOF
  bool shut = false;  // EOF forwarded to `to`
  double tokens = 0;
  Clock::time_point refilled = Clock::now();
};

struct Conn {
  int client = -1, upstream = -1;
  bool connected = false;
  bool dead = false;
  Dir c2u, u2c;
};

bool split_hostport(const std::string& s, std::string& host, std::string& port) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 == s.size()) return false;
  host = s.substr(0, colon);
  port = s.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return true;
}

addrinfo* resolve(const std::string& hostport, bool passive, std::string& err) {
  std::string host, port;
  if (!split_hostport(hostport, host, port)) {
    err = "expected ADDR:PORT, got '" + hostport + "'";
    return nullptr;
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    err = hostport + ": " + ::gai_strerror(rc);
    return nullptr;
  }
  return res;
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

class Proxy {
 public:
  Proxy(const Options& o, int listen_fd, addrinfo* target, int sig_fd)
      : o_(o), listen_fd_(listen_fd), target_(target), sig_fd_(sig_fd) {
    rate_ = o.rate_kbit > 0 ? o.rate_kbit * 1000.0 / 8.0 : 0;
    burst_ = std::max(1500.0, rate_ / 50);
  }

  int loop() {
    for (;;) {
      std::vector<pollfd> fds;
      std::vector<std::pair<Conn*, int>> owner;  // per pollfd: its connection and which fd
      fds.push_back({sig_fd_, POLLIN, 0});
      owner.push_back({nullptr, 0});
      if (!blackhole_) {
        fds.push_back({listen_fd_, POLLIN, 0});
        owner.push_back({nullptr, 1});
      }
      auto now = Clock::now();
      long timeout_ms = -1;
      auto wake_in = [&](Clock::duration d) {
        long ms = static_cast<long>(
            std::chrono::ceil<std::chrono::milliseconds>(std::max(d, Clock::duration::zero()))
                .count());
        if (timeout_ms < 0 || ms < timeout_ms) timeout_ms = ms;
      };
      if (!blackhole_) {
        for (Conn& c : conns_) {
          if (!c.connected) {
            fds.push_back({c.upstream, POLLOUT, 0});
            owner.push_back({&c, 2});
          }
          for (Dir* d : {&c.c2u, &c.u2c}) {
            short ev_from = 0, ev_to = 0;
            if (!d->eof && d->queued < kQueueCap) ev_from = POLLIN;
            if (c.connected && !d->q.empty()) {
              auto wait = write_wait(*d, now);
              if (wait <= Clock::duration::zero())
                ev_to = POLLOUT;
              else
                wake_in(wait);
            }
            if (d->from == c.upstream && !c.connected) ev_from = 0;
            if (ev_from) {
              fds.push_back({d->from, ev_from, 0});
              owner.push_back({&c, 3});
            }
            if (ev_to) {
              fds.push_back({d->to, ev_to, 0});
              owner.push_back({&c, 4});
            }
          }
        }
      }
      int r = ::poll(fds.data(), fds.size(), static_cast<int>(timeout_ms));
      if (r < 0 && errno != EINTR) {
        std::perror("fault_proxy: poll");
        return 1;
      }
      if (r > 0 && (fds[0].revents & POLLIN)) {
        signalfd_siginfo si;
        while (::read(sig_fd_, &si, sizeof si) == sizeof si) {
          if (si.ssi_signo == SIGUSR1 || si.ssi_signo == SIGUSR2) {
            blackhole_ = si.ssi_signo == SIGUSR1;
            std::printf("blackhole %s\n", blackhole_ ? "on" : "off");  // tests wait for it
            std::fflush(stdout);
          }
          if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) return 0;
        }
      }
      if (blackhole_) continue;  // the black hole starts at once, even mid-batch
      if (r > 0 && fds.size() > 1 && owner[1].second == 1 && (fds[1].revents & POLLIN))
        accept_all();
      // Every connection makes what progress it can (the fds are non-blocking).
      for (std::size_t k = 0; k < fds.size(); ++k) {
        if (owner[k].first != nullptr && owner[k].second == 2 && fds[k].revents != 0)
          finish_connect(*owner[k].first);
      }
      for (Conn& c : conns_) {
        if (c.dead) continue;
        for (Dir* d : {&c.c2u, &c.u2c}) {
          if (!c.dead) pump(c, *d);
        }
      }
      conns_.remove_if([](const Conn& c) { return c.dead; });
    }
  }

 private:
  // How long until the head of d may be written (zero or less: now).
  Clock::duration write_wait(Dir& d, Clock::time_point now) {
    if (d.q.empty()) return Clock::duration::max();
    const Chunk& head = d.q.front();
    if (head.due > now) return head.due - now;
    if (rate_ <= 0) return Clock::duration::zero();
    refill(d, now);
    double need = std::min<double>(head.data.size() - head.off, 1024.0);
    if (d.tokens >= need) return Clock::duration::zero();
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>((need - d.tokens) / rate_));
  }

  void refill(Dir& d, Clock::time_point now) {
    double secs = std::chrono::duration<double>(now - d.refilled).count();
    d.tokens = std::min(burst_, d.tokens + secs * rate_);
    d.refilled = now;
  }

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      set_nodelay(fd);
      int up = -1;
      for (addrinfo* a = target_; a != nullptr && up < 0; a = a->ai_next) {
        up = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (up < 0) continue;
        if (::connect(up, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
          ::close(up);
          up = -1;
        }
      }
      if (up < 0) {
        ::close(fd);
        continue;
      }
      set_nodelay(up);
      Conn& c = conns_.emplace_back();
      c.client = fd;
      c.upstream = up;
      c.c2u.from = fd;
      c.c2u.to = up;
      c.u2c.from = up;
      c.u2c.to = fd;
      c.c2u.tokens = c.u2c.tokens = burst_;
    }
  }

  void finish_connect(Conn& c) {
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(c.upstream, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      kill(c, true);  // the target refused: the client sees a reset, as it would directly
      return;
    }
    c.connected = true;
  }

  // Reads what is there, writes what is due. Errors end the connection.
  void pump(Conn& c, Dir& d) {
    if (!(d.from == c.upstream && !c.connected)) {
      char buf[kReadSize];
      while (!d.eof && d.queued < kQueueCap) {
        ssize_t got = ::recv(d.from, buf, sizeof buf, 0);
        if (got > 0) {
          d.q.push_back({Clock::now() + std::chrono::milliseconds(o_.delay_ms),
                         std::string(buf, static_cast<std::size_t>(got))});
          d.queued += static_cast<std::size_t>(got);
        } else if (got == 0) {
          d.eof = true;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
          break;
        } else if (errno != EINTR) {
          kill(c, true);
          return;
        }
      }
    }
    if (!c.connected) return;
    auto now = Clock::now();
    while (!d.q.empty() && write_wait(d, now) <= Clock::duration::zero()) {
      Chunk& head = d.q.front();
      std::size_t n = head.data.size() - head.off;
      if (rate_ > 0) n = std::min(n, static_cast<std::size_t>(d.tokens));
      if (n == 0) break;
      ssize_t put = ::send(d.to, head.data.data() + head.off, n, MSG_NOSIGNAL);
      if (put < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        kill(c, true);
        return;
      }
      head.off += static_cast<std::size_t>(put);
      d.queued -= static_cast<std::size_t>(put);
      if (rate_ > 0) d.tokens -= static_cast<double>(put);
      if (head.off == head.data.size()) d.q.pop_front();
    }
    if (d.eof && d.q.empty() && !d.shut) {
      ::shutdown(d.to, SHUT_WR);
      d.shut = true;
    }
    if (c.c2u.shut && c.u2c.shut) kill(c, false);
  }

  void kill(Conn& c, bool reset) {
    for (int fd : {c.client, c.upstream}) {
      if (reset) {
        linger l{1, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
      }
      ::close(fd);
    }
    c.dead = true;
  }

  const Options& o_;
  int listen_fd_;
  addrinfo* target_;
  int sig_fd_;
  double rate_ = 0, burst_ = 0;  // bytes/s and bytes, per direction
  bool blackhole_ = false;
  std::list<Conn> conns_;  // a list: pump() holds references while others are added
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fault_proxy: a TCP proxy with delay, rate limit and a black hole (see source)"};
  app.add_option("--listen", o.listen, "ADDR:PORT to listen on (PORT may be 0)")->required();
  app.add_option("--target", o.target, "HOST:PORT to forward to")->required();
  app.add_option("--delay_ms", o.delay_ms, "one-way delay per direction")->check(CLI::NonNegativeNumber);
  app.add_option("--rate_kbit", o.rate_kbit, "rate cap per direction, kbit/s (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--port_file", o.port_file, "write the bound port here once listening");
  CLI11_PARSE(app, argc, argv);

  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaddset(&set, s);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  int sig_fd = ::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
  ::signal(SIGPIPE, SIG_IGN);

  std::string err;
  addrinfo* target = resolve(o.target, false, err);
  if (target == nullptr) {
    std::fprintf(stderr, "fault_proxy: --target %s\n", err.c_str());
    return 2;
  }
  addrinfo* la = resolve(o.listen, true, err);
  if (la == nullptr) {
    std::fprintf(stderr, "fault_proxy: --listen %s\n", err.c_str());
    return 2;
  }
  int lfd = ::socket(la->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (lfd < 0 || ::bind(lfd, la->ai_addr, la->ai_addrlen) != 0 || ::listen(lfd, 128) != 0) {
    std::fprintf(stderr, "fault_proxy: cannot listen on %s: %s\n", o.listen.c_str(),
                 std::strerror(errno));
    return 2;
  }
  ::freeaddrinfo(la);
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&bound), &blen);
  int port = ntohs(bound.ss_family == AF_INET6
                       ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                       : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (!o.port_file.empty()) {
    std::string tmp = o.port_file + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr || std::fprintf(f, "%d\n", port) < 0 || std::fclose(f) != 0 ||
        std::rename(tmp.c_str(), o.port_file.c_str()) != 0) {
      std::fprintf(stderr, "fault_proxy: cannot write %s\n", o.port_file.c_str());
      return 2;
    }
  }
  std::printf("listening on %d\n", port);
  std::fflush(stdout);

  Proxy proxy(o, lfd, target, sig_fd);
  int rc = proxy.loop();
  ::freeaddrinfo(target);
  return rc;
}
