// examples/train: mixed-precision data-parallel training of an MLP on a synthetic teacher task,
// resumable from checkpoints. Run it under launch, e.g.
//   launch --standalone --nproc_per_node=4 build/examples/train/train --checkpoint-dir /tmp/ck
// See docs/train.md.
#include <cstdio>
#include <unistd.h>
#include <iostream>
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "muster/worker/runtime.h"
#include "trainer.h"

using namespace muster;

// In place: how long a worker whose ring failed waits for the agent's next world (the agent
// itself bounds the whole recovery by --in_place_timeout and ends the worker after it).
constexpr std::chrono::minutes kWorldWait{5};

// The ring this rank trains on; in place, rebuilt in each new world.
struct Ring {
  worker::Runtime& rt;
  worker::Backend backend;
  bool in_place;
  std::unique_ptr<worker::Communicator> comm;

  // The first ring. In place, a loss while it forms waits for the world after it.
  absl::Status form() {
    auto c = rt.communicator(backend);
    while (!c.ok() && in_place) {
      if (!rt.await_world(kWorldWait).ok()) break;
      c = rt.communicator(backend);
    }
    if (!c.ok()) return c.status();
    comm = std::move(*c);
    return absl::OkStatus();
  }

  // After a failed collective: the next world's ring, and ctx pointed at it.
  absl::Status reform(train::TrainContext& ctx) {
    const int was = rt.info().rank;
    comm.reset();  // the aborted ring's sockets go now
    for (;;) {
      auto world = rt.await_world(kWorldWait);
      if (!world.ok()) return world.status();
      auto next = rt.communicator(backend);
      if (!next.ok()) continue;  // lost again while forming: the world after this one
      std::string lost;
      for (int x : world->lost) lost += (lost.empty() ? "" : ",") + std::to_string(x);
      std::printf("rank %d: pid %d re-formed in place as rank %d of %d, round %d (lost: %s)\n",
                  was, static_cast<int>(::getpid()), world->rank, world->world_size,
                  world->round, lost.empty() ? "none" : lost.c_str());
      std::fflush(stdout);
      comm = std::move(*next);
      ctx.comm = comm.get();
      ctx.store = &rt.store();
      ctx.restart_count = world->restart_count;
      return absl::OkStatus();
    }
  }
};

int main(int argc, char** argv) {
  train::TrainOptions o;
  std::string precision = "bf16", device = "auto";
  CLI::App app{"examples/train: data-parallel mixed-precision training of an MLP (run it under launch)"};
  app.add_option("--steps", o.steps, "Steps to train in all")->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "Samples per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "Peak learning rate (after warm-up)")->check(CLI::PositiveNumber);
  app.add_option("--min-lr", o.min_lr, "Learning rate at the end of the cosine decay")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", o.warmup, "Warm-up steps")->check(CLI::PositiveNumber);
  app.add_option("--precision", precision, "Compute precision")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  app.add_option("--device", device, "Where to compute (auto: CUDA when a GPU is visible)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--seed", o.seed, "Seed of the task, the data and the initial weights");
  app.add_option("--hidden", o.shape.hidden, "Hidden width")->check(CLI::PositiveNumber);
  app.add_option("--depth", o.shape.depth, "Hidden layers")->check(CLI::PositiveNumber);
  app.add_option("--growth-interval", o.growth_interval, "Loss scaler: finite steps before the scale doubles")
      ->check(CLI::PositiveNumber);
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "Folder for checkpoints, shared by every node (none: no checkpoints)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "Steps between checkpoints")
      ->check(CLI::PositiveNumber);
  app.add_option("--log-every", o.log_every, "Steps between loss lines")->check(CLI::PositiveNumber);
  app.add_option("--fail-at-step", o.fail_at_step, "Test switch: exit at this step (first attempt only)");
  app.add_option("--fail-rank", o.fail_rank, "Test switch: the rank that exits");
  app.add_option("--hang-at-step", o.hang_at_step, "Test switch: block forever in the data loader at this step (first attempt only)");
  app.add_option("--hang-rank", o.hang_rank, "Test switch: the rank that hangs");
  app.add_option("--inject-inf-at-step", o.inject_inf_at_step, "Test switch: an inf gradient at this step (first attempt only)");
  app.add_option("--inject-inf-rank", o.inject_inf_rank, "Test switch: the rank with the inf gradient");
  app.add_option("--dump-params", o.dump_params, "Rank 0 writes the final fp32 parameters to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "train: %s\n", e.what());
    return 2;
  }
  o.precision = precision == "fp32" ? train::Precision::kF32
                : precision == "fp16" ? train::Precision::kF16 : train::Precision::kBF16;
  if (o.warmup >= o.steps) o.warmup = std::max<std::int64_t>(1, o.steps / 10);

  auto rt = worker::Runtime::from_env();
  if (!rt.ok()) {
    std::fprintf(stderr, "train: %s\n", std::string(rt.status().message()).c_str());
    return 2;
  }
  const worker::WorkerInfo& info = (*rt)->info();
  const bool cuda = device == "cuda" || (device == "auto" && train::cuda_available());
  std::unique_ptr<train::Engine> engine;
  if (cuda) {
    auto e = train::make_cuda_engine(o.shape, o.precision, o.seed, o.batch, info.local_rank);
    if (!e.ok()) {
      std::fprintf(stderr, "train: %s\n", std::string(e.status().message()).c_str());
      return 1;
    }
    engine = std::move(*e);
  } else {
    engine = train::make_cpu_engine(o.shape, o.precision, o.seed, o.batch);
  }
  const worker::Backend backend = cuda ? worker::Backend::kNccl : worker::Backend::kTcp;
  // Under launch --in_place this program re-forms in place (docs/in_place.md); elsewhere
  // enable_in_place() says there is no control channel and nothing changes.
  Ring ring{**rt, backend, (*rt)->enable_in_place().ok()};
  if (absl::Status s = ring.form(); !s.ok()) {
    std::fprintf(stderr, "train: rank %d: %s\n", info.rank, std::string(s.message()).c_str());
    return 1;
  }
  train::TrainContext ctx{ring.comm.get(), *engine, &(*rt)->store(), info.restart_count,
                          std::cout, &(*rt)->progress_reporter(), {}, {}};
  if (ring.in_place) {
    std::printf("rank %d: pid %d in place, round %d\n", info.rank, static_cast<int>(::getpid()),
                info.round);
    std::fflush(stdout);
    ctx.reform = [&ring, &ctx] { return ring.reform(ctx); };
    ctx.resumed = [&rt] { (void)(*rt)->resumed(); };
  }
  if (absl::Status s = train::train(o, ctx); !s.ok()) {
    std::fprintf(stderr, "train: rank %d: %s\n", info.rank, std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
