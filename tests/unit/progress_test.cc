// The worker's side of the progress page: ProgressReporter, Runtime::progress and the Python
// module (python/muster_progress.py) write what read_progress (the agent's side) reads back.
#include "muster/worker/progress.h"

#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "muster/worker/runtime.h"
#include "proc.h"

using namespace muster::worker;
using muster::testing::Proc;
using muster::testing::TempDir;
using namespace std::chrono_literals;

namespace {

// A page as the agent makes it: kProgressPageBytes zero bytes, then magic and version.
std::string make_page(const TempDir& dir, const std::string& name = "progress",
                      std::uint32_t magic = kProgressMagic, std::size_t bytes = kProgressPageBytes) {
  std::string page(bytes, '\0');
  if (bytes >= 8) {
    std::memcpy(page.data(), &magic, 4);
    std::memcpy(page.data() + 4, &kProgressVersion, 4);
  }
  const std::string path = dir.file(name);
  std::ofstream(path, std::ios::binary).write(page.data(), static_cast<std::streamsize>(bytes));
  return path;
}

// What the agent reads from the page at `path`.
ProgressSnapshot read_page(const std::string& path) {
  std::string bytes = muster::testing::read_file(path);
  REQUIRE(bytes.size() >= kProgressPageBytes);
  ProgressPage page;
  std::memcpy(&page, bytes.data(), sizeof page);
  ProgressSnapshot s;
  REQUIRE(read_progress(&page, &s));
  CHECK(page.seq % 2 == 0);
  return s;
}

std::map<std::string, std::string> worker_env(const std::string& page) {
  return {{"RANK", "0"}, {"LOCAL_RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_WORLD_SIZE", "1"},
          {"GROUP_RANK", "0"}, {"GROUP_WORLD_SIZE", "1"}, {"ROLE_RANK", "0"},
          {"ROLE_WORLD_SIZE", "1"}, {"ROLE_NAME", "default"}, {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RESTART_COUNT", "0"},
          {"TORCHELASTIC_MAX_RESTARTS", "0"}, {"TORCHELASTIC_RUN_ID", "job"},
          {"MUSTER_STORE_ADDR", "127.0.0.1:1"}, {"MUSTER_RUN_ID", "job"}, {"MUSTER_ROUND", "1"},
          {kProgressFileVar, page}};
}

}  // namespace

TEST_CASE("progress: reports reach the page the agent reads", "[progress]") {
  TempDir dir;
  const std::string path = make_page(dir);
  ProgressReporter p(path);
  REQUIRE(p.active());
  const std::uint64_t before = monotonic_ns();
  p.report(7, "all_reduce");
  ProgressSnapshot s = read_page(path);
  CHECK(s.step == 7);
  CHECK(s.phase == "all_reduce");
  CHECK(s.reports == 1);
  CHECK(s.time_ns >= before);
  CHECK(s.time_ns <= monotonic_ns());

  const std::uint64_t first_time = s.time_ns;
  p.report(8);
  s = read_page(path);
  CHECK(s.step == 8);
  CHECK(s.phase.empty());
  CHECK(s.reports == 2);
  CHECK(s.time_ns >= first_time);
}

TEST_CASE("progress: a long phase is cut to 63 bytes, a negative step is 0", "[progress]") {
  TempDir dir;
  const std::string path = make_page(dir);
  ProgressReporter p(path);
  p.report(-5, std::string(100, 'x'));
  ProgressSnapshot s = read_page(path);
  CHECK(s.phase == std::string(63, 'x'));
  CHECK(s.step == 0);
}

TEST_CASE("progress: no page, or an unusable one, makes a no-op reporter", "[progress]") {
  TempDir dir;
  ProgressReporter none;
  CHECK_FALSE(none.active());
  none.report(1, "forward");
  CHECK_FALSE(ProgressReporter::from_env({}).active());
  CHECK_FALSE(ProgressReporter(std::string()).active());

  ProgressReporter missing(dir.file("absent"));
  CHECK_FALSE(missing.active());
  missing.report(1, "forward");

  const std::string short_path = make_page(dir, "short", kProgressMagic, 100);
  ProgressReporter short_page(short_path);
  CHECK_FALSE(short_page.active());
  short_page.report(1, "forward");
  CHECK(muster::testing::read_file(short_path).size() == 100);

  const std::string foreign = make_page(dir, "foreign", 0xdeadbeefu);
  ProgressReporter wrong_magic(foreign);
  CHECK_FALSE(wrong_magic.active());
  wrong_magic.report(1, "forward");
  const std::string bytes = muster::testing::read_file(foreign);
  CHECK(bytes.find_first_not_of('\0', 8) == std::string::npos);  // untouched
}

TEST_CASE("progress: a moved reporter keeps the page", "[progress]") {
  TempDir dir;
  const std::string path = make_page(dir);
  ProgressReporter a(path);
  ProgressReporter b(std::move(a));
  CHECK_FALSE(a.active());  // NOLINT(bugprone-use-after-move): moved-from is documented empty
  REQUIRE(b.active());
  b.report(3, "optimizer");
  CHECK(read_page(path).step == 3);
}

TEST_CASE("progress: Runtime::progress writes the page named in the environment", "[progress]") {
  TempDir dir;
  const std::string path = make_page(dir);
  auto rt = Runtime::from_env(worker_env(path));
  REQUIRE(rt.ok());
  (*rt)->progress(7, "all_reduce");
  ProgressSnapshot s = read_page(path);
  CHECK(s.step == 7);
  CHECK(s.phase == "all_reduce");
  CHECK(s.reports == 1);
  (*rt)->progress(8, "optimizer");
  CHECK(read_page(path).reports == 2);

  // Without the variable (torchrun): a no-op.
  auto env = worker_env(path);
  env.erase(kProgressFileVar);
  auto plain = Runtime::from_env(env);
  REQUIRE(plain.ok());
  (*plain)->progress(9, "forward");
  CHECK_FALSE((*plain)->progress_reporter().active());
  CHECK(read_page(path).step == 8);
}

TEST_CASE("progress: the Python module writes the same bytes", "[progress][python]") {
  TempDir dir;
  const std::string path = make_page(dir);
  const std::string script = std::string("import sys; sys.path.insert(0, '") + MUSTER_PYTHON_DIR +
                             "'); import muster_progress as p; p.step(5, 'data'); "
                             "print('reported', flush=True)";
  const std::uint64_t before = monotonic_ns();
  Proc py({"/usr/bin/python3", "-c", script}, {{kProgressFileVar, path}});
  REQUIRE(py.wait(30s) == 0);
  INFO(py.err());
  CHECK(py.out() == "reported\n");
  ProgressSnapshot s = read_page(path);
  CHECK(s.step == 5);
  CHECK(s.phase == "data");
  CHECK(s.reports == 1);
  CHECK(s.time_ns >= before);
  CHECK(s.time_ns <= monotonic_ns());

  // phase() changes only the phase.
  Proc ph({"/usr/bin/python3", "-c",
           std::string("import sys; sys.path.insert(0, '") + MUSTER_PYTHON_DIR +
               "'); import muster_progress as p; p.phase('all_reduce')"},
          {{kProgressFileVar, path}});
  REQUIRE(ph.wait(30s) == 0);
  ProgressSnapshot t = read_page(path);
  CHECK(t.phase == "all_reduce");
  CHECK(t.step == 5);
  CHECK(t.reports == 1);
  CHECK(t.time_ns == s.time_ns);

  // Cut and clamped as in C++; the count goes on, also across writers.
  Proc more({"/usr/bin/python3", "-c",
             std::string("import sys; sys.path.insert(0, '") + MUSTER_PYTHON_DIR +
                 "'); import muster_progress as p; p.step(-1, 'y' * 100)"},
            {{kProgressFileVar, path}});
  REQUIRE(more.wait(30s) == 0);
  t = read_page(path);
  CHECK(t.step == 0);
  CHECK(t.phase == std::string(63, 'y'));
  CHECK(t.reports == 2);
  ProgressReporter(path).report(6, "forward");
  t = read_page(path);
  CHECK(t.step == 6);
  CHECK(t.reports == 3);
}

TEST_CASE("progress: the Python module without a page is a no-op", "[progress][python]") {
  TempDir dir;
  const std::string script = std::string("import sys; sys.path.insert(0, '") + MUSTER_PYTHON_DIR +
                             "'); import muster_progress as p; p.step(1, 'a'); p.phase('b'); "
                             "p.step(2); print('ok')";
  Proc no_var({"/usr/bin/python3", "-c", script}, {{kProgressFileVar, std::nullopt}});
  REQUIRE(no_var.wait(30s) == 0);
  CHECK(no_var.out() == "ok\n");
  CHECK(no_var.err().empty());

  const std::string foreign = make_page(dir, "foreign", 0xdeadbeefu);
  Proc bad({"/usr/bin/python3", "-c", script}, {{kProgressFileVar, foreign}});
  REQUIRE(bad.wait(30s) == 0);
  CHECK(bad.out() == "ok\n");
  CHECK(muster::testing::count_lines_with(bad.err(), "progress reports off") == 1);
}

TEST_CASE("progress: phase names map to the straggler watch's kinds", "[progress]") {
  CHECK(phase_kind("data_loader") == kData);
  CHECK(phase_kind("input") == kData);
  CHECK(phase_kind("forward") == kCompute);
  CHECK(phase_kind("forward_backward") == kCompute);
  CHECK(phase_kind("backward") == kComm);  // DDP's all-reduce overlaps it
  CHECK(phase_kind("all_reduce") == kComm);
  CHECK(phase_kind("reduce_scatter") == kComm);
  CHECK(phase_kind("optimizer") == kOptimizer);
  CHECK(phase_kind("between_steps") == kOther);
  CHECK(phase_kind("checkpoint") == kOther);
  CHECK(phase_kind("") == kOther);
}

// The time of each phase goes to its kind when the next phase begins (a report or a phase
// alone); the reader adds the phase under way. Lower bounds only: the pauses are this test's
// own (sleep_for), how much longer they took is the machine's.
TEST_CASE("progress: each phase's time goes to its kind, from C++ and from Python",
          "[progress][python]") {
  TempDir dir;
  const std::string path = make_page(dir);
  ProgressReporter p(path);
  p.report(1, "data_loader");
  std::this_thread::sleep_for(20ms);
  p.report(1, "forward");
  std::this_thread::sleep_for(10ms);
  p.phase("all_reduce");
  ProgressSnapshot s = read_page(path);
  CHECK(s.kind == kComm);
  CHECK(s.kind_ns[kData] >= 20'000'000u);
  CHECK(s.kind_ns[kCompute] >= 10'000'000u);
  CHECK(s.kind_ns[kComm] == 0);
  CHECK(s.kind_ns[kOptimizer] == 0);
  std::this_thread::sleep_for(5ms);
  std::uint64_t totals[kPhaseKinds];
  s.kind_totals(monotonic_ns(), totals);
  CHECK(totals[kComm] >= 5'000'000u);  // the phase under way
  CHECK(totals[kData] == s.kind_ns[kData]);

  // Python goes on from the same page: the all_reduce under way ends when it reports.
  Proc py({"/usr/bin/python3", "-c",
           std::string("import sys, time; sys.path.insert(0, '") + MUSTER_PYTHON_DIR +
               "'); import muster_progress as p; p.step(2, 'optimizer'); time.sleep(0.02); "
               "p.phase('checkpoint')"},
          {{kProgressFileVar, path}});
  REQUIRE(py.wait(30s) == 0);
  INFO(py.err());
  ProgressSnapshot t = read_page(path);
  CHECK(t.kind == kOther);
  CHECK(t.kind_ns[kComm] >= 5'000'000u);
  CHECK(t.kind_ns[kOptimizer] >= 20'000'000u);
  CHECK(t.kind_ns[kData] == s.kind_ns[kData]);
  CHECK(t.kind_ns[kCompute] == s.kind_ns[kCompute]);
}
