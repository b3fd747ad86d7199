// launch --preflight's transport (agent/preflight.h) on 127.0.0.1, port 0: a probe measures a
// rate; the listener's bounds hold (a connection beyond those served at once is closed at
// once; one that sends no valid header is closed).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <vector>

#include "muster/agent/preflight.h"

namespace pf = muster::agent::preflight;
using namespace std::chrono_literals;

namespace {

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

// Whether the server closed `fd` within `wait`: EOF, or a reset (it closed with our bytes
// unread).
bool closed_within(int fd, std::chrono::milliseconds wait) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
  char c;
  const ssize_t r = ::recv(fd, &c, 1, MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

}  // namespace

TEST_CASE("preflight: a probe of the listener measures a rate both ways", "[preflight]") {
  auto server = pf::ProbeServer::start("127.0.0.1");
  REQUIRE(server.ok());
  auto rate = pf::probe("127.0.0.1", (*server)->port(), 50ms);
  REQUIRE(rate.ok());
  CHECK(*rate > 0);
}

TEST_CASE("preflight: the listener closes a connection beyond those it serves at once, and one "
          "whose header is wrong",
          "[preflight]") {
  auto server = pf::ProbeServer::start("127.0.0.1");
  REQUIRE(server.ok());
  const int port = (*server)->port();
  std::vector<int> held;
  for (int i = 0; i < pf::kMaxProbeConnections; ++i) held.push_back(connect_to(port));
  // The listener's thread takes them one by one: the ones held stay open (no header yet).
  for (int fd : held) CHECK_FALSE(closed_within(fd, 100ms));
  const int extra = connect_to(port);
  CHECK(closed_within(extra, 5s));
  ::close(extra);
  for (int fd : held) ::close(fd);  // their threads end on EOF
  // Served again once those threads have seen their EOF (a probe refused before is tried again:
  // the threads' ends are not observable from here).
  auto serves = [&] {
    const auto end = std::chrono::steady_clock::now() + 10s;
    absl::StatusOr<double> rate = pf::probe("127.0.0.1", port, 20ms);
    while (!rate.ok() && std::chrono::steady_clock::now() < end) {
      rate = pf::probe("127.0.0.1", port, 20ms);
    }
    return rate.ok();
  };
  REQUIRE(serves());
  const int bad = connect_to(port);
  REQUIRE(::send(bad, "XXXXXXXX", 8, MSG_NOSIGNAL) == 8);
  CHECK(closed_within(bad, 5s));
  ::close(bad);
  // Still serving.
  CHECK(serves());
}
