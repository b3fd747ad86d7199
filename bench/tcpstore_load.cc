// The bootstrap of a big job against a TCPStore-protocol server, from one process: N
// connections, each (non-blocking; at most --inflight connecting at once, and as many started
// between two looks at the replies) connects, sends VALIDATE (--dialect 2, torch 2.x) and
// then, pipelined, ADD("count", 1) and WAIT(["go"]); the
// connection whose ADD answers N sets "go". Prints "bootstrap N SECONDS" (first connect to the
// last WAIT answered), then waits for a line on stdin before closing (so that the caller can
// read the server's RSS with every connection open). PORTS: one port, or several separated by
// commas (the agents of a job: connection i goes to port i mod their number).
// --total T: the barrier is T ranks in all (this process holds N of them; the others are other
// processes', as a process may hold only so many descriptors): the connection whose ADD
// answers T sets "go".
//   tcpstore_load PORTS N [--dialect 1|2] [--inflight K] [--total T]
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "../rendezvous/src/common/tcpstore_protocol.h"

namespace wire = muster::rendezvous::tcpstore;

namespace {

struct C {
  int fd = -1;
  bool connected = false;
  std::string out;
  std::size_t sent = 0;
  std::string in;
  bool added = false, done = false;
};

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "tcpstore_load: %s\n", why.c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) die("usage: tcpstore_load PORTS N [--dialect 1|2] [--inflight K]");
  std::vector<int> ports;
  for (const char* p = argv[1]; *p != '\0';) {
    ports.push_back(std::atoi(p));
    p = std::strchr(p, ',');
    if (p == nullptr) break;
    ++p;
  }
  const int n = std::atoi(argv[2]);
  wire::Dialect dialect = wire::Dialect::kTorch2;
  int inflight = 256;
  long total = 0;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--dialect") == 0) {
      dialect = std::atoi(argv[i + 1]) == 1 ? wire::Dialect::kTorch1 : wire::Dialect::kTorch2;
    } else if (std::strcmp(argv[i], "--inflight") == 0) {
      inflight = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--total") == 0) {
      total = std::atol(argv[i + 1]);
    } else {
      die(std::string("unknown flag ") + argv[i]);
    }
  }
  if (total == 0) total = n;
  rlimit nofile{};
  ::getrlimit(RLIMIT_NOFILE, &nofile);
  // Root may raise the hard limit too (100,000 ranks' worth).
  if (nofile.rlim_max < static_cast<rlim_t>(n) + 1024) {
    rlimit more{static_cast<rlim_t>(n) + 1024, static_cast<rlim_t>(n) + 1024};
    if (::setrlimit(RLIMIT_NOFILE, &more) == 0) nofile = more;
  }
  nofile.rlim_cur = nofile.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &nofile);
  if (nofile.rlim_cur < static_cast<rlim_t>(n) + 64) die("RLIMIT_NOFILE is too low for N");

  wire::Request v, add, wait, go;
  v.op = wire::Op::kValidate;
  v.number = wire::kValidationMagic;
  add.op = wire::Op::kAdd;
  add.keys = {"count"};
  add.delta = 1;
  wait.op = wire::Op::kWait;
  wait.keys = {"go"};
  go.op = wire::Op::kSet;
  go.keys = {"go"};
  go.values = {"1"};
  std::string hello = dialect == wire::Dialect::kTorch2 ? wire::encode(dialect, v) : "";
  hello += wire::encode(dialect, add) + wire::encode(dialect, wait);
  const std::string go_frame = wire::encode(dialect, go);

  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  std::vector<C> cs(static_cast<std::size_t>(n));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int next = 0, connecting = 0, finished = 0;
  auto start_one = [&] {
    C& c = cs[static_cast<std::size_t>(next)];
    c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c.fd < 0) die(std::string("socket: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    a.sin_port = htons(static_cast<std::uint16_t>(ports[static_cast<std::size_t>(next) % ports.size()]));
    if (::connect(c.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno != EINPROGRESS)
      die(std::string("connect: ") + std::strerror(errno));
    c.out = hello;
    // On loopback the handshake is done when connect returns (EINPROGRESS all the same): the
    // frames go at once, as a rank's would (its process has nothing else to do); only when the
    // socket does not take them yet does it wait to be writable.
    const ssize_t w = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (w > 0) c.sent = static_cast<std::size_t>(w);
    c.connected = c.sent == c.out.size();
    epoll_event e{};
    e.events = c.connected ? EPOLLIN : EPOLLIN | EPOLLOUT;
    e.data.u32 = static_cast<std::uint32_t>(next);
    ::epoll_ctl(ep, EPOLL_CTL_ADD, c.fd, &e);
    ++next;
    if (!c.connected) ++connecting;
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<epoll_event> evs(1024);
  while (finished < n) {
    // At most K started between two looks at what came back (those sent at once count too).
    for (int k = 0; k < inflight && next < n && connecting < inflight; ++k) start_one();
    const int k = ::epoll_wait(ep, evs.data(), static_cast<int>(evs.size()), 30000);
    if (k == 0) die("no progress in 30 s (" + std::to_string(finished) + " of N done)");
    for (int i = 0; i < k; ++i) {
      C& c = cs[evs[i].data.u32];
      if (evs[i].events & (EPOLLERR | EPOLLHUP)) die("a connection failed or was closed");
      if ((evs[i].events & EPOLLOUT) && c.sent < c.out.size()) {
        if (!c.connected) {
          c.connected = true;
          --connecting;
        }
        const ssize_t w = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (w > 0) c.sent += static_cast<std::size_t>(w);
        if (c.sent == c.out.size()) {
          epoll_event e{};
          e.events = EPOLLIN;
          e.data.u32 = evs[i].data.u32;
          ::epoll_ctl(ep, EPOLL_CTL_MOD, c.fd, &e);
        }
      }
      if (evs[i].events & EPOLLIN) {
        char buf[256];
        const ssize_t r = ::recv(c.fd, buf, sizeof buf, 0);
        if (r <= 0) die("the server closed a connection");
        c.in.append(buf, static_cast<std::size_t>(r));
        if (!c.added && c.in.size() >= 8) {
          std::int64_t count = 0;
          std::memcpy(&count, c.in.data(), 8);
          c.in.erase(0, 8);
          c.added = true;
          if (count == total) {  // the last one in: release everyone
            c.out = go_frame;
            c.sent = 0;
            epoll_event e{};
            e.events = EPOLLIN | EPOLLOUT;
            e.data.u32 = evs[i].data.u32;
            ::epoll_ctl(ep, EPOLL_CTL_MOD, c.fd, &e);
          }
        }
        if (c.added && !c.done && !c.in.empty()) {
          if (static_cast<std::uint8_t>(c.in[0]) != wire::kStopWaiting) die("a wrong WAIT answer");
          c.done = true;
          ++finished;
        }
      }
    }
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("bootstrap %d %.6f\n", n, secs);
  std::fflush(stdout);
  std::string line;
  std::getline(std::cin, line);
  for (C& c : cs) ::close(c.fd);
  return 0;
}
