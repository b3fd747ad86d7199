#include "trainer.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <ostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint.h"
#include "scaler.h"

namespace muster::train {

using worker::DType;
using worker::ReduceOp;

std::string fingerprint(const TrainOptions& o) {
  const Shape& s = o.shape;
  return absl::StrCat("mlp in=", s.in, " hidden=", s.hidden, " depth=", s.depth, " out=", s.out,
                      " teacher=", s.teacher_hidden, " seed=", o.seed);
}

__attribute__((noinline)) void hang_forever_in_data_loader(worker::ProgressReporter& progress,
                                                           std::int64_t step) {
  progress.report(step, "data_loader");
  for (;;) ::pause();
}

namespace {

// Where a run starts: the latest checkpoint, or the seed's initial parameters.
struct Start {
  std::int64_t step = 0, adam_steps = 0;
  std::vector<float> params, m, v;
};

absl::StatusOr<Start> load_start(const TrainOptions& o, std::size_t n, LossScaler& scaler) {
  Start st;
  st.params = initial_params(o.shape, o.seed);
  st.m.assign(n, 0.0f);
  st.v.assign(n, 0.0f);
  if (o.checkpoint_dir.empty()) return st;
  std::error_code ec;
  std::filesystem::create_directories(o.checkpoint_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", o.checkpoint_dir, ": ", ec.message()));
  auto c = load_checkpoint(o.checkpoint_dir);
  if (!c.ok()) {
    if (c.status().code() != absl::StatusCode::kNotFound) return c.status();
    return st;
  }
  if (c->fingerprint != fingerprint(o) || c->params.size() != n) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint in ", o.checkpoint_dir, " belongs to another model (", c->fingerprint,
        "; this run: ", fingerprint(o), ")"));
  }
  st.step = c->step;
  st.adam_steps = c->adam_steps;
  scaler.restore(c->scale, c->growth_tracker);
  st.params = std::move(c->params);
  st.m = std::move(c->m);
  st.v = std::move(c->v);
  return st;
}

// Every rank must resume from the same step (a checkpoint folder shared by every node).
absl::Status agree_on_start(const TrainOptions& o, TrainContext& ctx, std::int64_t step) {
  const int rank = ctx.comm->rank();
  const int world = ctx.comm->size();
  if (absl::Status s = ctx.store->set(absl::StrCat("train/resume/", rank), std::to_string(step));
      !s.ok()) {
    return s;
  }
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(absl::StrCat("train/resume/", r));
  auto steps = ctx.store->multi_get(keys, std::chrono::minutes(5));
  if (!steps.ok()) return steps.status();
  for (int r = 0; r < world; ++r) {
    if ((*steps)[r] != std::to_string(step)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, " resumes after step ", (*steps)[r], " but rank ", rank, " after step ",
          step, ": is ", o.checkpoint_dir, " shared by every node?"));
    }
  }
  return absl::OkStatus();
}

// Rank 0's last lines: the final loss and speed, and the parameters when asked.
absl::Status report_end(const TrainOptions& o, TrainContext& ctx, std::int64_t first_step,
                        std::int64_t step, float loss, double secs) {
  if (step == first_step) {
    ctx.out << absl::StrFormat("final: nothing to do, the checkpoint is at step %d\n", step);
    return absl::OkStatus();
  }
  const double samples =
      static_cast<double>(step - first_step) * static_cast<double>(o.batch) * ctx.comm->size();
  std::string perf = ctx.engine.perf_summary();
  ctx.out << absl::StrFormat("final loss %.6f steps %d samples/s %.0f%s\n", loss, step,
                             secs > 0 ? samples / secs : 0.0,
                             perf.empty() ? "" : absl::StrCat(", ", perf))
          << std::flush;
  if (o.dump_params.empty()) return absl::OkStatus();
  std::vector<float> p, mm, vv;
  ctx.engine.get_state(p, mm, vv);
  std::ofstream f(o.dump_params, std::ios::binary);
  f.write(reinterpret_cast<const char*>(p.data()), static_cast<std::streamsize>(p.size() * sizeof(float)));
  if (!f) return absl::InternalError("cannot write " + o.dump_params);
  return absl::OkStatus();
}

// In place: the ranks of a (re-)formed world agree on who holds the newest training state
// and take it from there. Each rank says the last step it completed (-1: it holds no state
// of this run in memory, a new process); the one with the highest step (the lowest rank of
// those) broadcasts its step, optimizer step, loss scale and parameters with Adam's moments.
// A survivor whose all_reduce of step k failed while another's completed resumes after k.
// Returns whether any rank had state (if none, each starts from the checkpoint as before).
absl::StatusOr<bool> sync_state(TrainContext& ctx, bool have, std::int64_t& step,
                                std::int64_t& adam_steps, LossScaler& scaler) {
  worker::Communicator& comm = *ctx.comm;
  const int world = comm.size();
  std::vector<std::int64_t> all(static_cast<std::size_t>(world) * 2);
  // Each rank: the step of its state in memory (-1: none), and the step it would start from.
  const std::int64_t mine[2] = {have ? step : -1, step};
  if (absl::Status s = comm.all_gather(mine, all.data(), 2, DType::kI64); !s.ok()) return s;
  int source = -1;
  std::int64_t best = -1;
  for (int r = 0; r < world; ++r) {
    if (all[2 * r] > best) {
      best = all[2 * r];
      source = r;
    }
  }
  if (source < 0) {
    // Nobody holds state: every rank starts from the checkpoint, which must be the same one
    // (agree_on_start's rule, here without a store wait that a loss could leave hanging).
    for (int r = 0; r < world; ++r) {
      if (all[2 * r + 1] != step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", r, " resumes after step ", all[2 * r + 1], " but rank ", comm.rank(),
            " after step ", step, ": is the checkpoint folder shared by every node?"));
      }
    }
    return false;
  }
  double head[4] = {static_cast<double>(step), static_cast<double>(adam_steps), scaler.scale(),
                    static_cast<double>(scaler.growth_tracker())};
  if (absl::Status s = comm.broadcast(head, 4, DType::kF64, source); !s.ok()) return s;
  std::vector<float> p, m, v;
  ctx.engine.get_state(p, m, v);
  for (std::vector<float>* buf : {&p, &m, &v}) {
    if (absl::Status s = comm.broadcast(buf->data(), buf->size(), DType::kF32, source); !s.ok()) {
      return s;
    }
  }
  ctx.engine.set_state(p, m, v);
  step = static_cast<std::int64_t>(head[0]);
  adam_steps = static_cast<std::int64_t>(head[1]);
  scaler.restore(static_cast<float>(head[2]), static_cast<std::int64_t>(head[3]));
  if (comm.rank() == 0) {
    ctx.out << absl::StrFormat("train: in place: %d rank(s), resuming after step %d (state from "
                               "rank %d)\n",
                               world, step, source)
            << std::flush;
  }
  return true;
}

// After a failed collective: the next world, and the state agreed in it. A failure while
// re-forming (another loss) waits for the world after that one.
// A collective's failure that a new world may cure (a peer lost, an abort), not a bad
// checkpoint.
bool lost_peer(const absl::Status& s) {
  return s.code() == absl::StatusCode::kCancelled || s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

// `have`: this rank holds state (it completed a sync before); whether any rank did.
absl::StatusOr<bool> recover(TrainContext& ctx, const absl::Status& why, bool have,
                             std::int64_t& step, std::int64_t& adam_steps, LossScaler& scaler) {
  if (!ctx.reform) return why;
  absl::Status last = why;
  for (;;) {
    if (absl::Status s = ctx.reform(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(last.message(), "; then: ", s.message()));
    }
    auto synced = sync_state(ctx, have, step, adam_steps, scaler);
    if (synced.ok() || !lost_peer(synced.status())) return synced;
    last = synced.status();
  }
}

// Where this rank starts: the checkpoint (or the seed's parameters), which every rank must
// share; in place, the state of a running group's survivors when there are any.
absl::Status start_run(const TrainOptions& o, TrainContext& ctx, LossScaler& scaler,
                       std::int64_t& step, std::int64_t& adam_steps) {
  auto start = load_start(o, ctx.engine.num_params(), scaler);
  if (!start.ok()) return start.status();
  step = start->step;
  adam_steps = start->adam_steps;
  ctx.engine.set_state(start->params, start->m, start->v);
  if (!ctx.reform) return agree_on_start(o, ctx, step);
  // In place, a new process may join a running group: the survivors hand it their state.
  auto synced = sync_state(ctx, false, step, adam_steps, scaler);
  // A loss already during start-up: the next world, still without state of its own.
  if (!synced.ok() && lost_peer(synced.status())) {
    synced = recover(ctx, synced.status(), false, step, adam_steps, scaler);
  }
  return synced.status();
}

}  // namespace

absl::Status train(const TrainOptions& o, TrainContext& ctx) {
  worker::ProgressReporter no_page;
  worker::ProgressReporter& progress = ctx.progress != nullptr ? *ctx.progress : no_page;
  Engine& engine = ctx.engine;
  const std::size_t n = engine.num_params();
  LossScaler scaler({o.precision != Precision::kF32, 65536.0f, 2.0f, 0.5f, o.growth_interval});

  std::int64_t step = 0, adam_steps = 0;
  if (absl::Status s = start_run(o, ctx, scaler, step, adam_steps); !s.ok()) return s;
  if (ctx.comm->rank() == 0) {
    ctx.out << absl::StrFormat(
        "train: %d rank(s) on %s, %s, %zu parameters, global batch %d, %s step %d of %d\n",
        ctx.comm->size(), engine.device(), precision_name(o.precision), n,
        o.batch * ctx.comm->size(), step > 0 ? "resuming after" : "from", step, o.steps)
            << std::flush;
  }

  const auto t0 = std::chrono::steady_clock::now();
  const std::int64_t first_step = step;
  float loss = 0.0f;
  bool resumed = false;  // this round's first step is done (in place: said to the agent)
  while (step < o.steps) {
    // The world may change in place between steps: rank and size are read each step. The
    // per-rank batch stays; the global batch is batch x world (docs/in_place.md).
    worker::Communicator& comm = *ctx.comm;
    const int rank = comm.rank();
    const std::int64_t global_batch = static_cast<std::int64_t>(o.batch) * comm.size();
    ++step;
    const bool first_attempt = ctx.restart_count == 0;
    if (first_attempt && step == o.fail_at_step && rank == o.fail_rank) {
      ctx.out << absl::StrFormat("rank %d: injected failure at step %d\n", rank, step) << std::flush;
      std::_Exit(3);
    }
    if (first_attempt && step == o.hang_at_step && rank == o.hang_rank) {
      ctx.out << absl::StrFormat("rank %d: injected hang at step %d\n", rank, step) << std::flush;
      hang_forever_in_data_loader(progress, step);
    }
    const float scale = scaler.scale();
    // One engine call runs both passes, so one phase names both.
    progress.report(step, "forward_backward");
    engine.forward_backward((step - 1) * global_batch + static_cast<std::int64_t>(rank) * o.batch,
                            o.batch, scale);
    if (first_attempt && step == o.inject_inf_at_step && rank == o.inject_inf_rank) {
      engine.poison_gradient();
    }
    progress.report(step, "all_reduce");
    if (absl::Status s = comm.all_reduce(engine.grad_buffer(), n + 1, DType::kF32, ReduceOp::kAvg,
                                         engine.stream());
        !s.ok()) {
      --step;  // not completed here: the group agrees on where to go on from
      if (ctx.reform) {
        ctx.out << absl::StrFormat("rank %d: step %d: %s; re-forming in place\n", rank, step + 1,
                                   std::string(s.message()))
                << std::flush;
      }
      if (auto r = recover(ctx, s, true, step, adam_steps, scaler); !r.ok()) return r.status();
      resumed = false;
      continue;
    }
    progress.report(step, "optimizer");
    const bool finite = engine.unscale_and_check(1.0f / scale);
    loss = engine.loss_slot();
    const float lr = learning_rate(step, o.warmup, o.steps, o.lr, o.min_lr);
    if (finite) {
      engine.adam_step(o.adam, lr, ++adam_steps);
    } else {
      ctx.out << absl::StrFormat(
                     "rank %d: step %d: non-finite gradients, step skipped, loss scale %g -> %g\n",
                     rank, step, scale, scale * 0.5f)
              << std::flush;
    }
    scaler.update(finite);
    if (!resumed) {
      resumed = true;
      if (ctx.resumed) ctx.resumed();
    }
    if (rank == 0 && (step % o.log_every == 0 || step == 1 || step == o.steps)) {
      ctx.out << absl::StrFormat("step %d loss %.6f lr %.3g scale %g\n", step, loss, lr,
                                 scaler.scale())
              << std::flush;
    }
    if (rank == 0 && !o.checkpoint_dir.empty() && o.checkpoint_every > 0 &&
        step % o.checkpoint_every == 0) {
      Checkpoint c{fingerprint(o), step, adam_steps, scaler.scale(), scaler.growth_tracker(), {}, {}, {}};
      progress.phase("checkpoint");  // rank 0 only: not a report the others also make
      engine.get_state(c.params, c.m, c.v);
      if (absl::Status s = save_checkpoint(o.checkpoint_dir, c); !s.ok()) return s;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (ctx.comm->rank() == 0) return report_end(o, ctx, first_step, step, loss, secs);
  return absl::OkStatus();
}

}  // namespace muster::train
