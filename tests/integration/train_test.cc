// examples/train under launch: data-parallel equivalence, convergence, elastic resume from a
// checkpoint, and the loss scaler's decision on every rank.
#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>

#include <catch2/catch.hpp>

#include "helpers.h"

using namespace muster::testing;

namespace {

const std::string kTrain = TRAIN_BIN;

std::vector<std::string> train_args(int nproc, const std::vector<std::string>& flags,
                                    const std::vector<std::string>& launch_flags = {}) {
  std::vector<std::string> argv{kLaunch, "--standalone", "--nproc_per_node=" + std::to_string(nproc)};
  argv.insert(argv.end(), launch_flags.begin(), launch_flags.end());
  argv.push_back(kTrain);
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> v(s.size() / sizeof(float));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(float));
  return v;
}

// The "final loss X" of rank 0's last line.
std::string final_loss(const std::string& out) {
  std::smatch m;
  static const std::regex re(R"(final loss (\S+) steps)");
  return std::regex_search(out, m, re) ? m[1].str() : "";
}

double loss_at_step(const std::string& out, int step) {
  std::smatch m;
  const std::regex re("\\]:step " + std::to_string(step) + " loss (\\S+)");
  return std::regex_search(out, m, re) ? std::stod(m[1].str()) : -1;
}

}  // namespace

TEST_CASE("train: 4 ranks with batch B match 1 rank with batch 4B (fp32)", "[train]") {
  TempDir dir;
  const std::vector<std::string> common{"--precision", "fp32", "--steps", "10", "--warmup", "3"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return extra;
  };
  Proc four(train_args(4, with({"--batch", "8", "--dump-params", dir.path() + "/four"})));
  INFO(four.err());
  REQUIRE(four.wait(120s) == 0);
  Proc one(train_args(1, with({"--batch", "32", "--dump-params", dir.path() + "/one"})));
  INFO(one.err());
  REQUIRE(one.wait(120s) == 0);
  const auto a = read_floats(dir.path() + "/four"), b = read_floats(dir.path() + "/one");
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() > 10000);
  float worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  CHECK(worst < 1e-5f);
  CHECK(final_loss(four.out()) == final_loss(one.out()));
  // And the 10 steps did change the parameters (the comparison is not of two untouched copies).
  CHECK(loss_at_step(one.out(), 10) < loss_at_step(one.out(), 1));
}

TEST_CASE("train: the loss falls below a quarter of its start on the synthetic task", "[train]") {
  Proc p(train_args(2, {"--steps", "200", "--log-every", "50"}));
  INFO(p.out() << p.err());
  REQUIRE(p.wait(300s) == 0);
  const double first = loss_at_step(p.out(), 1);
  const std::string last = final_loss(p.out());
  REQUIRE(first > 0);
  REQUIRE_FALSE(last.empty());
  CHECK(std::stod(last) < 0.25 * first);
}

TEST_CASE("train: a rank failing mid-run resumes from the checkpoint and ends at the same loss",
          "[train]") {
  TempDir plain, elastic;
  const std::vector<std::string> common{"--steps", "40", "--checkpoint-every", "10", "--log-every", "10"};
  auto with = [&](const TempDir& d, std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    extra.insert(extra.end(), {"--checkpoint-dir", d.path()});
    return extra;
  };
  Proc uninterrupted(train_args(2, with(plain, {})));
  INFO(uninterrupted.err());
  REQUIRE(uninterrupted.wait(120s) == 0);
  Proc faulty(train_args(2, with(elastic, {"--fail-at-step", "25", "--fail-rank", "1"}),
                         {"--max_restarts=1"}));
  INFO(faulty.out() << faulty.err());
  REQUIRE(faulty.wait(120s) == 0);
  CHECK_THAT(faulty.out(), Catch::Contains("rank 1: injected failure at step 25"));
  CHECK_THAT(faulty.out(), Catch::Contains("resuming after step 20 of 40"));
  REQUIRE_FALSE(final_loss(uninterrupted.out()).empty());
  CHECK(final_loss(faulty.out()) == final_loss(uninterrupted.out()));
}

TEST_CASE("train: an inf gradient on one rank skips the step on every rank and halves the scale",
          "[train]") {
  Proc p(train_args(4, {"--steps", "6", "--log-every", "1", "--growth-interval", "2",
                        "--inject-inf-at-step", "3", "--inject-inf-rank", "2"}));
  INFO(p.out() << p.err());
  REQUIRE(p.wait(120s) == 0);
  for (int r = 0; r < 4; ++r) {
    CHECK_THAT(p.out(), Catch::Contains("rank " + std::to_string(r) +
                                        ": step 3: non-finite gradients, step skipped, loss scale 131072 -> 65536"));
  }
  std::smatch m;
  CHECK(std::regex_search(p.out(), m, std::regex(R"(\]:step 1 loss \S+ lr \S+ scale 65536\n)")));
  CHECK(std::regex_search(p.out(), m, std::regex(R"(\]:step 2 loss \S+ lr \S+ scale 131072\n)")));  // grew
  CHECK(std::regex_search(p.out(), m, std::regex(R"(\]:step 3 loss \S+ lr \S+ scale 65536\n)")));   // halved
  CHECK(std::regex_search(p.out(), m, std::regex(R"(\]:step 4 loss \S+ lr \S+ scale 65536\n)")));
  CHECK(std::regex_search(p.out(), m, std::regex(R"(\]:step 5 loss \S+ lr \S+ scale 131072\n)")));
}

TEST_CASE("train: bad flags and a missing worker environment give one line and exit 2", "[train]") {
  Proc bad({kTrain, "--precision", "fp8"});
  REQUIRE(bad.wait(30s) == 2);
  CHECK(std::count(bad.err().begin(), bad.err().end(), '\n') == 1);
  CHECK_THAT(bad.err(), Catch::Contains("precision"));
  Proc alone({kTrain}, {{"RANK", std::nullopt}, {"WORLD_SIZE", std::nullopt}});
  REQUIRE(alone.wait(30s) == 2);
  CHECK(std::count(alone.err().begin(), alone.err().end(), '\n') == 1);
  CHECK_THAT(alone.err(), Catch::Contains("under launch"));
}

// --hang_timeout (docs/hangs.md): rank 2 of 4 blocks forever in its data loader at step 15 (the
// others wait in that step's all_reduce). It is named with its step and phase, its stacks are
// dumped beside its logs, the group restarts and the job finishes.
TEST_CASE("train: a hung rank is named, its stacks dumped, and the restarted job finishes",
          "[train][hang]") {
  TempDir ckpt, logs;
  Proc p(train_args(4,
                    {"--steps", "30", "--checkpoint-every", "10", "--log-every", "10",
                     "--checkpoint-dir", ckpt.path(), "--hang-at-step", "15", "--hang-rank", "2"},
                    {"--max_restarts=1", "--hang_timeout=2", "--log_dir", logs.path()}));
  const auto rc = p.wait(180s);
  INFO(p.out() << p.err());
  REQUIRE(rc == 0);
  CHECK_THAT(p.out(), Catch::Contains("rank 2: injected hang at step 15"));
  std::smatch m;
  const std::string err = p.err();
  REQUIRE(std::regex_search(
      err, m,
      std::regex(R"(hang: rank 2 \(host \S+, local rank 2, pid \d+\) stuck at step 15 in phase )"
                 R"('data_loader' for \d+\.\d s; 3 ranks got further \(up to step 15\); writing )"
                 R"(its stacks to (\S+stacks\.txt))")));
  const std::string stacks = read_file(m[1].str());
  if (::access("/usr/bin/gdb", X_OK) == 0) {
    CHECK_THAT(stacks, Catch::Contains("hang_forever_in_data_loader"));
  } else {
    CHECK_THAT(stacks, Catch::Contains("no gdb on PATH"));
  }
  CHECK_THAT(err, Catch::Contains("restart 1 of 1"));
  CHECK_THAT(p.out(), Catch::Contains("resuming after step 10 of 30"));
  CHECK_FALSE(final_loss(p.out()).empty());
}
