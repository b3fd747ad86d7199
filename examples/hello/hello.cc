// A small worker for trying `launch`: prints where it sits in the job, then does a few
// seconds of arithmetic, reporting progress. Run it with:
//   launch --standalone --nproc_per_node=4 build/examples/hello/hello
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {
std::string env(const char* k) {
  const char* v = std::getenv(k);
  return v != nullptr ? v : "<unset>";
}
}  // namespace

int main(int argc, char** argv) {
  int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  std::printf("hello from rank %s of %s (local rank %s, master %s:%s, restart %s)\n",
              env("RANK").c_str(), env("WORLD_SIZE").c_str(), env("LOCAL_RANK").c_str(),
              env("MASTER_ADDR").c_str(), env("MASTER_PORT").c_str(),
              env("TORCHELASTIC_RESTART_COUNT").c_str());
  const int rank = std::atoi(env("RANK").c_str());
  double x = 1.0 + rank;
  for (int step = 1; step <= steps; ++step) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    long iters = 0;
    while (std::chrono::steady_clock::now() < until) {
      x = std::sqrt(x * x + 1.0) - 0.5;
      ++iters;
    }
    std::printf("step %d/%d: %ld iterations, x = %.6f\n", step, steps, iters, x);
    std::fflush(stdout);
  }
  return 0;
}
