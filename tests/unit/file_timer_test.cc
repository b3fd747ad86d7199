// torch's file-timer protocol (agent/file_timer.h): the parser, the rules with a fake clock, and
// the FIFO server on a real FIFO.
#include "muster/agent/file_timer.h"

#include <fcntl.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>

#include "proc.h"

using namespace muster::agent;
using namespace std::chrono_literals;

namespace {
WallTime at(double s) {
  return WallTime(std::chrono::duration_cast<WallTime::duration>(std::chrono::duration<double>(s)));
}
TimerRequest req(pid_t pid, const std::string& scope, double exp, int sig = 9) {
  TimerRequest r;
  r.pid = pid;
  r.scope_id = scope;
  r.expiration_time = exp;
  r.signal = sig;
  return r;
}
}  // namespace

TEST_CASE("file timer: torch's request lines parse", "[file_timer]") {
  // What FileTimerClient writes (json.dumps): an acquire and a release.
  auto a = parse_timer_request(
      R"({"version": 1, "pid": 4242, "scope_id": "train step", "expiration_time": 1767225600.25, "signal": 9})");
  REQUIRE(a.ok());
  CHECK(a->pid == 4242);
  CHECK(a->scope_id == "train step");
  CHECK(a->expiration_time == 1767225600.25);
  CHECK(a->signal == 9);
  auto r = parse_timer_request(
      R"({"version": 1, "pid": 4242, "scope_id": "train step", "expiration_time": -1, "signal": 0})");
  REQUIRE(r.ok());
  CHECK(r->expiration_time < 0);
  // Escapes, unknown keys, no signal (0: never signalled).
  auto e = parse_timer_request(R"({"pid":7,"scope_id":"a\"b\u00e9","expiration_time":5,"x":null})");
  REQUIRE(e.ok());
  CHECK(e->scope_id == "a\"b\xc3\xa9");
  CHECK(e->signal == 0);
}

TEST_CASE("file timer: bad requests are refused, not guessed", "[file_timer]") {
  for (const char* bad :
       {"", "{", "[]", R"({"pid": 1})", R"({"pid": "1", "scope_id": "s", "expiration_time": 1})",
        R"({"pid": 0, "scope_id": "s", "expiration_time": 1})",
        R"({"pid": 1.5, "scope_id": "s", "expiration_time": 1})",
        R"({"pid": 1, "scope_id": 3, "expiration_time": 1})",
        R"({"pid": 1, "scope_id": "s", "expiration_time": "soon"})",
        R"({"pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 99})",
        R"({"pid": 1, "scope_id": "s", "expiration_time": 1e999})",
        R"({"pid": 1, "scope_id": "s", "expiration_time": 1} trailing)"}) {
    INFO(bad);
    CHECK_FALSE(parse_timer_request(bad).ok());
  }
  std::string big = R"({"pid": 1, "scope_id": ")" + std::string(kMaxTimerRequestBytes, 'x') +
                    R"(", "expiration_time": 1})";
  CHECK_FALSE(parse_timer_request(big).ok());
}

TEST_CASE("file timer: acquire, replace, release and expiry", "[file_timer]") {
  FileTimerTable t;
  CHECK_FALSE(t.next_expiry().has_value());
  REQUIRE(t.apply(req(10, "a", 100)));
  REQUIRE(t.apply(req(10, "b", 50, 15)));
  REQUIRE(t.apply(req(11, "a", 200)));
  CHECK(t.next_expiry() == at(50));
  CHECK(t.take_expired(at(49.9)).empty());
  REQUIRE(t.apply(req(10, "b", 150, 15)));  // the same scope again replaces its timer
  CHECK(t.next_expiry() == at(100));
  REQUIRE(t.apply(req(11, "a", -1)));  // released
  CHECK(t.size() == 2);
  auto e = t.take_expired(at(160));
  REQUIRE(e.size() == 1);
  CHECK(e[0].pid == 10);
  CHECK(e[0].signal == 9);  // the first to expire ("a" at 100) gives the signal
  CHECK(e[0].scopes == std::vector<std::string>{"a", "b"});
  CHECK(t.size() == 0);  // the pid's timers are gone with it
  REQUIRE(t.apply(req(12, "a", 1)));
  t.clear(12);
  CHECK(t.take_expired(at(1000)).empty());
}

TEST_CASE("file timer: the table is bounded", "[file_timer]") {
  FileTimerTable t;
  std::size_t accepted = 0;
  for (std::size_t i = 0; i < kMaxFileTimers; ++i) accepted += t.apply(req(1, std::to_string(i), 1e9));
  REQUIRE(accepted == kMaxFileTimers);
  CHECK_FALSE(t.apply(req(1, "one more", 1e9)));
  CHECK(t.apply(req(1, "0", 2e9)));  // replacing one is still fine
  CHECK(t.apply(req(1, "0", -1)));   // and so is releasing
  CHECK(t.size() == kMaxFileTimers - 1);
}

TEST_CASE("file timer: the server reads the FIFO and reports an expired pid", "[file_timer]") {
  muster::testing::TempDir dir;
  boost::asio::io_context io;
  std::vector<FileTimerTable::Expired> seen;
  auto server = FileTimerServer::start(io, dir.file("timer"),
                                       [&](const FileTimerTable::Expired& e) {
                                         seen.push_back(e);
                                         io.stop();
                                       });
  REQUIRE(server.ok());
  // Two clients, as FileTimerClient does it: open non-blocking, one line, close. The first
  // timer expired a second ago; the second is far away.
  const double now_s = std::chrono::duration<double>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  for (const std::string& line :
       {R"({"version": 1, "pid": 777, "scope_id": "late", "expiration_time": )" +
            std::to_string(now_s - 1) + R"(, "signal": 9})",
        R"({"version": 1, "pid": 778, "scope_id": "fine", "expiration_time": )" +
            std::to_string(now_s + 3600) + R"(, "signal": 9})"}) {
    int fd = ::open(dir.file("timer").c_str(), O_WRONLY | O_NONBLOCK);
    REQUIRE(fd >= 0);
    const std::string text = line + "\n";
    REQUIRE(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
    ::close(fd);
  }
  io.run_for(10s);
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].pid == 777);
  CHECK(seen[0].scopes == std::vector<std::string>{"late"});
  server->reset();
  CHECK(::access(dir.file("timer").c_str(), F_OK) != 0);  // the FIFO is removed
}
