#include "muster/agent/failure.h"

#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>

#include "proc.h"

using muster::agent::format_failure_summary;
using muster::agent::read_error_file;

namespace {
muster::v1::WorkerFailure failure(int rank, int code, int sig) {
  muster::v1::WorkerFailure f;
  f.set_host("node0");
  f.set_rank(rank);
  f.set_local_rank(rank % 4);
  f.set_exit_code(code);
  f.set_signal(sig);
  f.set_pid(4242);
  f.set_timestamp_ms(1700000000000);
  f.set_error_file("/tmp/e/error.json");
  return f;
}
}  // namespace

TEST_CASE("summary: exit code, root cause first, torchrun's layout", "[failure]") {
  std::string s = format_failure_summary("train.py", failure(5, 3, 0), {});
  CHECK_THAT(s, Catch::StartsWith(std::string(60, '=') + "\ntrain.py FAILED\n"));
  CHECK_THAT(s, Catch::Contains("Failures:\n  <NO_OTHER_FAILURES>\n"));
  CHECK_THAT(s, Catch::Contains("Root Cause (first observed failure):\n[0]:\n"));
  CHECK_THAT(s, Catch::Contains("  host      : node0\n"));
  CHECK_THAT(s, Catch::Contains("  rank      : 5 (local_rank: 1)\n"));
  CHECK_THAT(s, Catch::Contains("  exitcode  : 3 (pid: 4242)\n"));
  CHECK_THAT(s, Catch::Contains("  error_file: <N/A>\n"));
  CHECK_THAT(s, Catch::Contains("  time      : 2023-11-"));
  CHECK_THAT(s, Catch::EndsWith(std::string(60, '=') + "\n"));
}

TEST_CASE("summary: a signal is shown as torchrun shows it", "[failure]") {
  std::string s = format_failure_summary("prog", failure(0, 0, SIGKILL), {});
  CHECK_THAT(s, Catch::Contains("  exitcode  : -9 (pid: 4242)\n"));
  CHECK_THAT(s, Catch::Contains("Signal 9 (SIGKILL) received by PID 4242"));
}

TEST_CASE("summary: other failures are listed after the root cause's header", "[failure]") {
  std::string s = format_failure_summary("prog", failure(0, 1, 0), {failure(3, 2, 0)});
  CHECK_THAT(s, Catch::Contains("Failures:\n[1]:\n"));
  CHECK_THAT(s, Catch::Contains("  rank      : 3 (local_rank: 3)\n  exitcode  : 2"));
  CHECK(s.find("<NO_OTHER_FAILURES>") == std::string::npos);
}

TEST_CASE("error file: torch's @record JSON feeds the summary", "[failure]") {
  muster::testing::TempDir dir;
  const std::string path = dir.file("error.json");
  std::ofstream(path)
      << R"({"message": {"message": "ValueError: bad batch", "extraInfo": )"
      << R"({"py_callstack": "Traceback (most recent call last):\n  x\nValueError: bad batch\n", "timestamp": "1700000000"}}})";
  auto f = failure(1, 1, 0);
  f.set_error_file(path);
  read_error_file(path, f);
  CHECK(f.message() == "ValueError: bad batch");
  CHECK_THAT(f.traceback(), Catch::StartsWith("Traceback (most recent call last):"));
  std::string s = format_failure_summary("train.py", f, {});
  CHECK_THAT(s, Catch::Contains("  error_file: " + path + "\n"));
  CHECK_THAT(s, Catch::Contains("  message   : ValueError: bad batch\n"));
  CHECK_THAT(s, Catch::Contains("  traceback : Traceback (most recent call last):\n  x\n"));
}

TEST_CASE("error file: a plain message, garbage, and no file", "[failure]") {
  muster::testing::TempDir dir;
  auto f = failure(1, 1, 0);
  std::ofstream(dir.file("plain.json")) << R"({"message": "out of memory"})";
  read_error_file(dir.file("plain.json"), f);
  CHECK(f.message() == "out of memory");
  auto g = failure(1, 1, 0);
  std::ofstream(dir.file("bad.json")) << "{not json";
  read_error_file(dir.file("bad.json"), g);
  read_error_file(dir.file("absent.json"), g);
  CHECK(g.message().empty());
  CHECK(g.traceback().empty());
}
