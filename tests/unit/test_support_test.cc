// The test harness's own promises (tests/support): the ports free_port() hands out, the skip
// exit code, the time factor.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <set>

#include "proc.h"
#include "skip.h"

using namespace muster::testing;

namespace {

bool binds(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

TEST_CASE("test support: free_port's ports are outside the kernel's own range and bindable",
          "[support]") {
  int lo = 0, hi = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> lo >> hi;
  REQUIRE(lo > 0);
  std::set<int> seen;
  for (int i = 0; i < 20; ++i) {
    const int p = free_port();
    INFO("port " << p << ", the kernel's range " << lo << "-" << hi);
    CHECK((p < lo || p > hi));
    CHECK(binds(p));
    CHECK(seen.insert(p).second);  // never the same one twice
  }
  const int pair = free_port_pair();
  REQUIRE(pair > 0);
  CHECK(seen.count(pair) == 0);
  CHECK(seen.count(pair + 1) == 0);
  CHECK(binds(pair));
  CHECK(binds(pair + 1));
}

TEST_CASE("test support: two processes taking ports at once never get the same one",
          "[support]") {
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipefd[0]);
    for (int i = 0; i < 50; ++i) {
      const int p = free_port();
      (void)!::write(pipefd[1], &p, sizeof p);
    }
    ::_exit(0);  // its locks go with it
  }
  ::close(pipefd[1]);
  std::set<int> mine;
  for (int i = 0; i < 50; ++i) mine.insert(free_port());
  std::set<int> theirs;
  int p = 0;
  while (::read(pipefd[0], &p, sizeof p) == static_cast<ssize_t>(sizeof p)) theirs.insert(p);
  ::close(pipefd[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(theirs.size() == 50);
  REQUIRE(mine.size() == 50);
  for (int q : theirs) {
    INFO("port " << q);
    CHECK(mine.count(q) == 0);
  }
}

TEST_CASE("test support: a Catch result maps to 0 or 1, never to the skip code", "[support]") {
  CHECK(catch_exit(0) == 0);
  for (int failures : {1, 76, 77, 78, 255}) CHECK(catch_exit(failures) == 1);
  CHECK(kSkipExit == 77);
}

TEST_CASE("test support: scaled() leaves a bound as it is by default", "[support]") {
  if (std::getenv("MUSTER_TEST_TIME_FACTOR") != nullptr)
    MUSTER_SKIP("MUSTER_TEST_TIME_FACTOR is set here; this case checks the default");
  CHECK(scaled(1500ms) == 1500ms);
}
