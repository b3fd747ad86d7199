// launch --event_log: the JSON lines a real launch writes for a failure and its recovery.
#include <catch2/catch.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "helpers.h"

using namespace muster::testing;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// A field's raw JSON value in one line ("\"worker_failed\"", "3", "{...}" is not needed).
std::string field(const std::string& line, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(line, m, std::regex("\"" + name + "\":(\"[^\"]*\"|-?[0-9]+)"))) return "";
  return m[1];
}

long long number(const std::string& line, const std::string& name) {
  const std::string v = field(line, name);
  REQUIRE_FALSE(v.empty());
  return std::stoll(v);
}

}  // namespace

TEST_CASE("event log: a failure and its recovery, phase by phase", "[launch][events]") {
  TempDir dir;
  const std::string log = dir.file("events.jsonl");
  // Rank 0 fails (exit 3) in the first attempt only; the restart then succeeds.
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--max_restarts=1",
                      "--event_log=" + log},
                     {"restart", dir.path(), "1"}));
  REQUIRE(p.wait(60s) == 0);
  // This launch hosts the rendezvous (standalone): the server's lines are in the file too.
  std::vector<std::string> lines, server_events;
  std::vector<std::string> events;
  for (const auto& l : lines_of(read_file(log))) {
    CHECK(l.front() == '{');
    CHECK(l.back() == '}');
    if (field(l, "source") == "\"server\"") {
      server_events.push_back(field(l, "event"));
      continue;
    }
    REQUIRE(field(l, "source") == "\"agent\"");
    lines.push_back(l);
    events.push_back(field(l, "event"));
  }
  CHECK(server_events == std::vector<std::string>{"\"node_joined\"", "\"round_formed\"",
                                                  "\"worker_failed\"", "\"restart\"",
                                                  "\"round_formed\"", "\"succeeded\""});
  // The server's Restart and the last worker's exit race: either may come first.
  REQUIRE(events.size() == 8);
  if (events[3] == "\"workers_stopped\"") std::swap(events[3], events[4]);
  REQUIRE(events == std::vector<std::string>{"\"round_formed\"", "\"workers_started\"",
                                             "\"worker_failed\"", "\"restart\"",
                                             "\"workers_stopped\"", "\"round_formed\"",
                                             "\"workers_started\"", "\"succeeded\""});
  const std::string& failed = lines[2];
  CHECK(number(failed, "rank") == 0);
  CHECK(number(failed, "exit_code") == 3);
  CHECK(number(failed, "round") == 1);
  CHECK(number(lines[5], "round") == 2);
  CHECK(number(lines[5], "restart_count") == 1);
  CHECK(field(lines[0], "time").size() == std::string("\"2026-12-01T18:23:02.110Z\"").size());
  // The recovery: noticed -> stopped -> formed -> started, each phase >= 0, summing up.
  const std::string& started = lines[6];
  REQUIRE(started.find("\"recovery\":{") != std::string::npos);
  CHECK(field(started, "cause") == "\"worker_failure\"");
  const long long a = number(started, "noticed_to_stopped_ms");
  const long long b = number(started, "stopped_to_formed_ms");
  const long long c = number(started, "formed_to_started_ms");
  const long long total = number(started, "total_ms");
  CHECK(a >= 0);
  CHECK(b >= 0);
  CHECK(c >= 0);
  CHECK(total >= a + b + c - 2);  // each phase rounded down on its own
  CHECK(total <= a + b + c + 2);
  CHECK(total < 10000);
  CHECK(lines[1].find("recovery") == std::string::npos);  // a first round is no recovery
}

TEST_CASE("event log: a file that cannot be opened is one error line", "[launch][events]") {
  Proc p(launch_args({"--standalone", "--event_log=/nonexistent/dir/events.jsonl"}, {"wait"}));
  CHECK(p.wait(30s) == 2);
  CHECK(p.err() ==
        "launch: error: --event_log: cannot open '/nonexistent/dir/events.jsonl' for append: No "
        "such file or directory\n");
  CHECK(p.out().empty());
}
