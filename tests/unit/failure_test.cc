#include "muster/agent/failure.h"
#include "muster/ops/text.h"

#include <catch2/catch.hpp>
#include <csignal>
#include <filesystem>
#include <fstream>

#include "muster/rendezvous/limits.h"
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

using muster::ops::is_valid_utf8;

TEST_CASE("error file: a huge message and traceback are cut with a note", "[failure]") {
  namespace limits = muster::rendezvous::limits;
  muster::testing::TempDir dir;
  const std::string path = dir.file("error.json");
  {
    // 9 MiB: a message of 5 MiB, then a traceback of 4 MiB whose end is the exception.
    std::ofstream out(path);
    out << R"({"message": {"message": "RuntimeError: )" << std::string(5 << 20, 'm')
        << R"(", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n)"
        << std::string(4 << 20, 't') << R"(\nRuntimeError: the end\n", "timestamp": "1"}}})";
  }
  auto f = failure(0, 1, 0);
  read_error_file(path, f);
  CHECK_THAT(f.message(), Catch::StartsWith("RuntimeError: mmm"));
  CHECK(f.message().size() <= limits::kMaxFailureMessageBytes);
  CHECK(f.message().size() > limits::kMaxFailureMessageBytes / 2);
  CHECK_THAT(f.message(), Catch::Contains("cut"));
  // Only a bounded prefix is read: the traceback after a 5 MiB message is not reached, and
  // the note says how large the file was.
  CHECK(f.traceback().size() <= limits::kMaxFailureTracebackBytes);
  CHECK_THAT(f.message(), Catch::Contains("the error file has " + std::to_string(std::filesystem::file_size(path)) + " bytes"));
  CHECK(is_valid_utf8(f.message()));
  CHECK(is_valid_utf8(f.traceback()));
  std::string s = format_failure_summary("train", f, {});
  CHECK_THAT(s, Catch::Contains("  message   : RuntimeError: mmm"));
}

TEST_CASE("error file: a message that fits with a long traceback keeps the traceback's end",
          "[failure]") {
  namespace limits = muster::rendezvous::limits;
  muster::testing::TempDir dir;
  const std::string path = dir.file("error.json");
  std::ofstream(path) << R"({"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "Traceback\n)"
                      << std::string(100 << 10, 't') << R"(\nValueError: x\n"}}})";
  auto f = failure(0, 1, 0);
  read_error_file(path, f);
  CHECK(f.message() == "ValueError: x");
  CHECK(f.traceback().size() <= limits::kMaxFailureTracebackBytes);
  CHECK_THAT(f.traceback(), Catch::EndsWith("ValueError: x\n"));
  CHECK_THAT(f.traceback(), Catch::Contains("cut"));
}

TEST_CASE("error file: invalid UTF-8 is replaced, valid text is kept", "[failure]") {
  muster::testing::TempDir dir;
  const std::string path = dir.file("error.json");
  // JSON itself must be UTF-8; a torch error file written from raw bytes may not be.
  std::ofstream(path) << "{\"message\": \"caf\xc3\xa9 \xff\xfe bad \xe2\x82\"}";
  auto f = failure(0, 1, 0);
  read_error_file(path, f);
  CHECK_THAT(f.message(), Catch::StartsWith("caf\xc3\xa9 "));
  CHECK_THAT(f.message(), Catch::Contains("bad"));
  CHECK(is_valid_utf8(f.message()));
}

TEST_CASE("error file: a plain string message of many MiB is cut", "[failure]") {
  namespace limits = muster::rendezvous::limits;
  muster::testing::TempDir dir;
  const std::string path = dir.file("error.json");
  std::ofstream(path) << R"({"message": ")" << std::string(9 << 20, 'p') << R"("})";
  auto f = failure(0, 1, 0);
  read_error_file(path, f);
  CHECK(f.message().size() <= limits::kMaxFailureMessageBytes);
  CHECK_THAT(f.message(), Catch::StartsWith("ppp"));
  CHECK_THAT(f.message(), Catch::Contains("cut"));
}
