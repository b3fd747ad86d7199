// The fastest a TCPStore-protocol server could answer torch's client on this machine: the
// ceiling of the `tcpstore` bench row's ratio, measured rather than argued. A store reduced to
// what the row's set+get needs (SET, WAIT, GET on a hash map; the same frame parser as
// muster's server; nothing bounded, one thread, no timers), on a bare epoll loop that, with
// --spin, never sleeps: it polls its sockets without blocking, so no query waits for it to
// wake (a core given to it for the whole run). Not a server to run: only the bench uses it.
// With ADD, VALIDATE and WAITs parked until their key is set, it is also the floor of the
// store_scale barrier (tcpstore_load's ranks) on this machine: every connection accepted and
// answered with nothing else done (no owner check, no agent, no limits).
// Prints "port N" once listening; serves until stdin closes.
//   tcpstore_ceiling [--spin]
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "../rendezvous/src/common/tcpstore_protocol.h"

namespace wire = muster::rendezvous::tcpstore;

namespace {

struct Conn {
  wire::Dialect dialect = wire::Dialect::kUnknown;
  std::string in;
};

[[noreturn]] void die(const char* why) {
  std::fprintf(stderr, "tcpstore_ceiling: %s: %s\n", why, std::strerror(errno));
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  const bool spin = argc > 1 && std::strcmp(argv[1], "--spin") == 0;
  rlimit nofile{};  // as many connections as the process may hold
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
    nofile.rlim_cur = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &nofile);
  }
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof a;
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(lfd, 1024) != 0 ||
      ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &alen) != 0) {
    die("listen");
  }
  const int ep = ::epoll_create1(0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = lfd;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
  ev.data.fd = STDIN_FILENO;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, STDIN_FILENO, &ev);
  std::printf("port %d\n", ntohs(a.sin_port));
  std::fflush(stdout);

  const wire::FrameLimits limits{1 << 20, 1 << 20, 1 << 10, 4 << 20};
  std::unordered_map<int, Conn> conns;
  std::unordered_map<std::string, std::string> table;
  std::unordered_map<std::string, std::int64_t> counters;
  std::unordered_map<std::string, std::vector<int>> parked;  // WAITs for a key not yet set
  std::vector<char> buf(64 << 10);
  std::string out;
  epoll_event events[64];
  for (;;) {
    const int n = ::epoll_wait(ep, events, 64, spin ? 0 : -1);
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == STDIN_FILENO) return 0;
      if (fd == lfd) {
        for (int c; (c = ::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK)) >= 0;) {
          const int one = 1;
          ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          ev.data.fd = c;
          ::epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev);
          conns[c];
        }
        continue;
      }
      const ssize_t got = ::recv(fd, buf.data(), buf.size(), 0);
      if (got <= 0) {
        if (got < 0 && errno == EAGAIN) continue;
        ::close(fd);
        conns.erase(fd);
        continue;
      }
      Conn& c = conns[fd];
      c.in.append(buf.data(), static_cast<std::size_t>(got));
      std::size_t pos = 0;
      out.clear();
      wire::Request r;
      for (;;) {
        const auto p = wire::parse(c.dialect, c.in.data() + pos, c.in.size() - pos, limits, r);
        if (p.what != wire::Parsed::kRequest) break;
        pos += p.consumed;
        if (r.op == wire::Op::kSet) {
          table[r.keys[0]] = std::move(r.values[0]);
          const auto w = parked.find(r.keys[0]);
          if (w != parked.end()) {
            const char stop = static_cast<char>(wire::kStopWaiting);
            for (const int f : w->second) ::send(f, &stop, 1, MSG_NOSIGNAL);
            parked.erase(w);
          }
        } else if (r.op == wire::Op::kAdd) {
          wire::put_i64(out, counters[r.keys[0]] += r.delta);
        } else if (r.op == wire::Op::kGet) {
          const auto it = table.find(r.keys[0]);
          wire::put_bytes(out, it == table.end() ? std::string() : it->second);
        } else if (r.op == wire::Op::kWait) {
          if (table.count(r.keys[0]) != 0) {
            wire::put_u8(out, wire::kStopWaiting);
          } else {
            parked[r.keys[0]].push_back(fd);
          }
        }
      }
      c.in.erase(0, pos);
      if (!out.empty()) ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
    }
  }
}
