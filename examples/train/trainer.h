// The training loop of examples/train: data-parallel, mixed precision, checkpointed.
//
// Each step: every rank runs forward/backward on its slice of the global batch (engine.h),
// one all_reduce averages the gradients and the loss, the loss scaler decides on the averaged
// gradients (so every rank decides alike), AdamW steps with a warm-up + cosine learning rate.
// Rank 0 writes a checkpoint every `checkpoint_every` steps; on start every rank loads the
// latest one and the ranks check that they resume from the same step.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>

#include "absl/status/status.h"
#include "engine.h"
#include "muster/rendezvous/store.h"
#include "muster/worker/comm/communicator.h"
#include "muster/worker/progress.h"

namespace muster::train {

struct TrainOptions {
  Shape shape;
  Precision precision = Precision::kBF16;
  std::uint64_t seed = 1;
  int batch = 32;  // per rank
  std::int64_t steps = 300;
  float lr = 3e-3f;
  float min_lr = 3e-4f;
  std::int64_t warmup = 30;
  AdamConfig adam;
  std::int64_t growth_interval = 2000;
  std::string checkpoint_dir;  // empty: no checkpoints
  std::int64_t checkpoint_every = 50;
  std::int64_t log_every = 20;
  // Fault switches for tests; each acts only on the first attempt (restart count 0).
  std::int64_t fail_at_step = -1;
  int fail_rank = 0;
  std::int64_t inject_inf_at_step = -1;
  int inject_inf_rank = 0;
  std::int64_t hang_at_step = -1;  // hang_forever_in_data_loader() at this step
  int hang_rank = 0;
  std::string dump_params;  // rank 0 writes the final fp32 parameters here (raw floats)
};

struct TrainContext {
  worker::Communicator* comm;
  Engine& engine;
  rendezvous::Store* store;  // this round's (ranks agree on the step they resume from)
  int restart_count = 0;
  std::ostream& out;  // progress lines
  // Where each step reports its phases for the agent's hang detection (Runtime::progress);
  // nullptr: nowhere.
  worker::ProgressReporter* progress = nullptr;
  // In-place recovery (docs/in_place.md; set only under launch --in_place). reform: after a
  // collective failed, wait for the next world and point comm, store and restart_count at
  // it (an error: give up, the agent restarts this worker). resumed: the first step of a
  // round completed.
  std::function<absl::Status()> reform;
  std::function<void()> resumed;
};

// The model and task a checkpoint belongs to.
std::string fingerprint(const TrainOptions& o);

// The --hang-at-step fault: reports phase "data_loader" at `step`, then blocks forever (until a
// signal ends the process), as a rank stuck reading its data would; the other ranks then wait
// in the step's all_reduce. Never inlined, so that a stack dump of the hung rank names it.
[[noreturn]] void hang_forever_in_data_loader(worker::ProgressReporter& progress,
                                              std::int64_t step);

// Runs the loop to o.steps. An error (a lost peer, a bad checkpoint) is returned as a Status.
absl::Status train(const TrainOptions& o, TrainContext& ctx);

}  // namespace muster::train
