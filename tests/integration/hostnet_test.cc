// HostNet (tests/support/hostnet.h), the hostnet CLI and fault_proxy, against real namespaces,
// sockets and processes. Exits 77 (ctest: Skipped) where namespaces cannot be made (not root,
// no `ip`, no CAP_NET_ADMIN).
//
// The binary is its own helper inside the hosts: `hostnet_tests --serve` (a TCP echo server on
// port 0 that prints "port N") and `hostnet_tests --connect HOST PORT TIMEOUT_MS` (exit 0: an
// echo round trip worked, 3: no answer in time, 4: refused or reset, 5: other error).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <regex>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "hostnet.h"
#include "proc.h"
#include "skip.h"

using namespace muster::testing;
using Clock = std::chrono::steady_clock;

namespace {

std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

// ---- helpers, also used inside the hosts ----

// A connected TCP socket (blocking), -1 with errno on failure, -2 when no answer in time.
int dial(const std::string& host, int port, int timeout_ms) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) {
    errno = EHOSTUNREACH;
    return -1;
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, timeout_ms) == 0) {
    ::close(fd);
    return -2;
  }
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    ::close(fd);
    errno = err;
    return -1;
  }
  ::fcntl(fd, F_SETFL, 0);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

bool send_all(int fd, const std::string& data) {
  std::size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<std::size_t>(n);
  }
  return true;
}

// Reads exactly n bytes unless `timeout` passes or the peer closes first.
std::string recv_n(int fd, std::size_t n, std::chrono::milliseconds timeout) {
  std::string got;
  auto deadline = Clock::now() + timeout;
  char buf[65536];
  while (got.size() < n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    ssize_t r = ::recv(fd, buf, std::min(sizeof buf, n - got.size()), 0);
    if (r <= 0) break;
    got.append(buf, static_cast<std::size_t>(r));
  }
  return got;
}

int serve_main() {
  int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  socklen_t len = sizeof a;
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(lfd, 16) != 0)
    return 5;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  std::printf("port %d\n", ntohs(a.sin_port));
  std::fflush(stdout);
  for (;;) {  // one connection at a time is all these tests need
    int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char buf[65536];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) {
      if (!send_all(fd, std::string(buf, static_cast<std::size_t>(n)))) break;
    }
    ::close(fd);
  }
}

int connect_main(const std::string& host, int port, int timeout_ms) {
  int fd = dial(host, port, timeout_ms);
  if (fd == -2) {
    std::printf("no answer\n");
    return 3;
  }
  if (fd < 0) {
    std::printf("error: %s\n", std::strerror(errno));
    return errno == ECONNREFUSED || errno == ECONNRESET ? 4 : 5;
  }
  bool echoed = send_all(fd, "ping\n") && recv_n(fd, 5, std::chrono::milliseconds(timeout_ms)) == "ping\n";
  ::close(fd);
  std::printf(echoed ? "echoed\n" : "no echo\n");
  return echoed ? 0 : 3;
}

// ---- test fixtures ----

std::unique_ptr<HostNet> make_net(int n) {
  auto net = HostNet::create(n);
  if (!net.ok()) FAIL("HostNet::create: " << net.status().message());
  return std::move(*net);
}

int port_of(Proc& server) {
  REQUIRE(server.wait_output([](const std::string& o, const std::string&) {
    return o.find('\n') != std::string::npos;
  }, 10s));
  std::smatch m;
  REQUIRE(std::regex_search(server.out(), m, std::regex("port (\\d+)")));
  return std::stoi(m[1]);
}

// Runs the connect helper in host `from`; its exit code.
int probe(const HostNet& net, int from, const std::string& to, int port, int timeout_ms) {
  return net.run(from, {self_exe(), "--connect", to, std::to_string(port),
                        std::to_string(timeout_ms)},
                 30s);
}

bool gone(const std::vector<std::string>& names) {
  Proc links({"/usr/sbin/ip", "-o", "link", "show"});
  Proc nss({"/usr/sbin/ip", "netns", "list"});
  // An `ip` that did not run lists nothing: that must not read as "nothing left".
  if (links.wait(10s) != 0 || nss.wait(10s) != 0) {
    UNSCOPED_INFO("`ip` failed: " << links.err() << nss.err());
    return false;
  }
  for (const auto& n : names) {
    if (links.out().find(n + ":") != std::string::npos ||
        links.out().find(n + "@") != std::string::npos) {
      UNSCOPED_INFO("link left: " << n);
      return false;
    }
    if (nss.out().find(n) != std::string::npos || std::filesystem::exists("/etc/netns/" + n)) {
      UNSCOPED_INFO("namespace left: " << n);
      return false;
    }
  }
  return true;
}

// Not a zombie either (a container's init may not reap the orphans it inherits).
bool alive(pid_t pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

std::vector<std::string> names_of(const HostNet& net) {
  std::vector<std::string> v{net.bridge()};
  for (int i = 0; i < net.size(); ++i) v.push_back(net.ns(i));
  return v;
}

// The port a fault_proxy says it listens on.
int proxy_port(Proc& proxy) {
  REQUIRE(proxy.wait_output([](const std::string& o, const std::string&) {
    return o.find("listening on ") != std::string::npos && o.back() == '\n';
  }, 10s));
  std::smatch m;
  REQUIRE(std::regex_search(proxy.out(), m, std::regex("listening on (\\d+)")));
  return std::stoi(m[1]);
}

Clock::duration round_trip(int fd, const std::string& msg) {
  auto t0 = Clock::now();
  REQUIRE(send_all(fd, msg));
  REQUIRE(recv_n(fd, msg.size(), 10s) == msg);
  return Clock::now() - t0;
}

long ms(Clock::duration d) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

}  // namespace

TEST_CASE("hosts have their names, addresses and hosts files, wrapped pids are the program's") {
  auto net = make_net(2);
  REQUIRE(net->addr(0) != net->addr(1));
  REQUIRE(net->addr(0).rfind("198.1", 0) == 0);

  Proc host(net->wrap(0, {"hostname"}));
  REQUIRE(host.wait(10s) == 0);
  CHECK(host.out() == "node0\n");

  Proc getent(net->wrap(0, {"getent", "hosts", "node1"}));
  REQUIRE(getent.wait(10s) == 0);
  CHECK(getent.out().rfind(net->addr(1) + " ", 0) == 0);

  // The pid Proc started is the final program's: sh's $$ is its own pid.
  Proc sh(net->wrap(1, {"sh", "-c", "echo $$; exec sleep 30"}));
  REQUIRE(sh.wait_output([](const std::string& o, const std::string&) {
    return o.find('\n') != std::string::npos;
  }, 10s));
  CHECK(std::stoi(sh.out()) == sh.pid());
  ::kill(sh.pid(), SIGTERM);
  CHECK(sh.wait(10s) == 128 + SIGTERM);  // the exit status is the program's own

  // The root namespace (the test) reaches every host through the bridge, and hosts reach
  // each other by name.
  Proc server(net->wrap(1, {self_exe(), "--serve"}));
  int port = port_of(server);
  int fd = dial(net->addr(1), port, 5000);
  REQUIRE(fd >= 0);
  round_trip(fd, "hello");
  ::close(fd);
  CHECK(probe(*net, 0, "node1", port, 5000) == 0);
  CHECK(net->run(0, {"sh", "-c", "exit 7"}) == 7);

  REQUIRE(net->set_resolver(0, net->unused_addr()).ok());
  Proc resolv(net->wrap(0, {"cat", "/etc/resolv.conf"}));
  REQUIRE(resolv.wait(10s) == 0);
  CHECK(resolv.out().find("nameserver " + net->unused_addr()) != std::string::npos);

  ::kill(server.pid(), SIGKILL);  // ended by its pid before its host goes
  server.wait(10s);
  auto names = names_of(*net);
  net.reset();
  CHECK(gone(names));
}

TEST_CASE("cut drops a host's packets silently and heal restores it") {
  auto net = make_net(3);
  Proc server(net->wrap(1, {self_exe(), "--serve"}));
  int port = port_of(server);
  REQUIRE(probe(*net, 0, net->addr(1), port, 5000) == 0);

  REQUIRE(net->cut(1).ok());
  REQUIRE(net->cut(1).ok());  // idempotent
  auto t0 = Clock::now();
  CHECK(probe(*net, 0, net->addr(1), port, 1500) == 3);  // no answer: not refused, not reset
  CHECK(Clock::now() - t0 >= 1400ms);
  CHECK(probe(*net, 2, net->addr(1), port, 1000) == 3);
  int fd = dial(net->addr(1), port, 1000);  // from the root namespace too
  CHECK(fd == -2);
  // Packets are dropped, the link is not taken down: no carrier lost, no neighbour table
  // flushed (ip6tables too: a missing one used to fall back to taking the link down).
  CHECK(net->run(1, {"sh", "-c", "ip link show dev eth0 | grep -q LOWER_UP"}) == 0);
  CHECK(net->run(1, {"sh", "-c", "ip6tables -S INPUT | grep -q DROP"}) == 0);

  REQUIRE(net->heal(1).ok());
  CHECK(probe(*net, 0, net->addr(1), port, 5000) == 0);

  SECTION("cut_between cuts only one pair") {
    REQUIRE(net->cut_between(0, 1).ok());
    CHECK(probe(*net, 0, net->addr(1), port, 1000) == 3);
    CHECK(probe(*net, 2, net->addr(1), port, 5000) == 0);
    REQUIRE(net->heal_between(0, 1).ok());
    CHECK(probe(*net, 0, net->addr(1), port, 5000) == 0);
  }
  // A closed port still answers with a reset: the cut is what made the silence above.
  Proc closed(net->wrap(2, {self_exe(), "--serve"}));
  int other = port_of(closed);
  ::kill(closed.pid(), SIGKILL);
  closed.wait(10s);
  CHECK(probe(*net, 0, net->addr(2), other, 5000) == 4);
}

TEST_CASE("rate_limit slows a host's link both ways, clear_limits lifts it") {
  auto net = make_net(1);
  Proc server(net->wrap(0, {self_exe(), "--serve"}));
  int port = port_of(server);
  std::string blob(256 * 1024, 'x');
  auto echo = [&]() {
    int fd = dial(net->addr(0), port, 5000);
    REQUIRE(fd >= 0);
    auto d = round_trip(fd, blob);
    ::close(fd);
    return d;
  };
  REQUIRE(net->rate_limit(0, 2048).ok());  // 256 KiB at 2 Mbit/s: about 1 s
  auto slow = echo();
  REQUIRE(net->clear_limits(0).ok());
  REQUIRE(net->clear_limits(0).ok());  // idempotent
  auto fast = echo();
  INFO("limited " << ms(slow) << " ms, unlimited " << ms(fast) << " ms");
  CHECK(slow >= 800ms);
  CHECK(fast < scaled(400ms));
}

TEST_CASE("fault_proxy delays each direction, keeps bytes intact, and black-holes on SIGUSR1") {
  auto net = make_net(2);
  Proc server(net->wrap(1, {self_exe(), "--serve"}));
  int port = port_of(server);
  // The proxy runs in host 0 and reaches the server by name; the test connects through it.
  Proc proxy(net->wrap(0, {FAULT_PROXY_BIN, "--listen", net->addr(0) + ":0", "--target",
                           "node1:" + std::to_string(port), "--delay_ms", "100"}));
  int pport = proxy_port(proxy);

  int direct = dial(net->addr(1), port, 5000);
  REQUIRE(direct >= 0);
  auto base = round_trip(direct, "x");
  ::close(direct);

  int fd = dial(net->addr(0), pport, 5000);
  REQUIRE(fd >= 0);
  auto delayed = round_trip(fd, "x");
  INFO("direct " << ms(base) << " ms, through the proxy " << ms(delayed) << " ms");
  CHECK(delayed >= 200ms);  // 100 ms each way
  CHECK(delayed < scaled(1000ms));

  // 1 MiB of random bytes comes back intact; being a stream, it is delayed once, not per chunk.
  std::mt19937 rng(7);
  std::string blob(1 << 20, '\0');
  for (auto& c : blob) c = static_cast<char>(rng());
  auto t0 = Clock::now();
  REQUIRE(send_all(fd, blob));
  CHECK(recv_n(fd, blob.size(), 20s) == blob);
  CHECK(Clock::now() - t0 < scaled(3s));

  // Black hole: nothing comes back, the connection stays open; SIGUSR2 resumes it.
  REQUIRE(::kill(proxy.pid(), SIGUSR1) == 0);
  REQUIRE(proxy.wait_output([](const std::string& o, const std::string&) {
    return o.find("blackhole on\n") != std::string::npos;
  }, 10s));
  REQUIRE(send_all(fd, "y"));
  CHECK(recv_n(fd, 1, 700ms).empty());
  REQUIRE(::kill(proxy.pid(), SIGUSR2) == 0);
  CHECK(recv_n(fd, 1, 5s) == "y");
  ::close(fd);

  ::kill(proxy.pid(), SIGTERM);
  CHECK(proxy.wait(10s) == 0);
}

TEST_CASE("two instances at once get their own /24 and names") {
  auto a = make_net(1);
  auto b = make_net(1);
  CHECK(a->gateway() != b->gateway());
  CHECK(a->bridge() != b->bridge());
  CHECK(a->ns(0) != b->ns(0));
}

TEST_CASE("hostnet run: a script makes hosts, starts, cuts and heals, and nothing is left") {
  std::string script = R"SH(
    set -e
    echo "ns $HOSTNET_NS_0 $HOSTNET_NS_1 $HOSTNET_NS_2"
    $HOSTNET_WRAP_1 sleep 300 &
    echo "sleeper $!"
    [ "$($HOSTNET_WRAP_2 hostname)" = node2 ]
    $HOSTNET_WRAP_0 getent hosts node2 | grep -q "^$HOSTNET_ADDR_2 "
    $HOSTNET_CTL cut $HOSTNET_NS_1
    $HOSTNET_CTL heal $HOSTNET_NS_1
    $HOSTNET_CTL rate $HOSTNET_NS_1 1000
    $HOSTNET_CTL unrate $HOSTNET_NS_1
    exit 3
  )SH";
  Proc run({HOSTNET_BIN, "run", "3", "--", "/bin/sh", "-c", script});
  REQUIRE(run.wait(60s) == 3);  // the script's own status
  INFO(run.out() << run.err());
  std::smatch m;
  REQUIRE(std::regex_search(run.out(), m, std::regex("ns (\\S+) (\\S+) (\\S+)")));
  CHECK(gone({m[1], m[2], m[3]}));
  REQUIRE(std::regex_search(run.out(), m, std::regex("sleeper (\\d+)")));
  const pid_t sleeper = std::stoi(m[1]);
  CHECK(!alive(sleeper));  // the sleeper in host 1 was ended
  if (alive(sleeper)) ::kill(sleeper, SIGKILL);
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--serve") return serve_main();
  if (argc >= 5 && std::string(argv[1]) == "--connect")
    return connect_main(argv[2], std::stoi(argv[3]), std::stoi(argv[4]));
  {
    auto probe_net = HostNet::create(1);
    if (!probe_net.ok()) {
      std::printf("skipped: %s\n", std::string(probe_net.status().message()).c_str());
      return kSkipExit;
    }
  }
  return catch_exit(Catch::Session().run(argc, argv));
}
