// Simulated agents for the rendezvous benchmarks: N gRPC Session streams over a few
// channels (callback API, no thread per stream) against a real rendezvous server.
//
// Protocol with the runner (bench/run): the tool connects every stream, prints "ready",
// waits for a line "go" on stdin, sends every Join, and once each agent holds `--rounds`
// assignments prints "first_join_ns <t> last_assignment_ns <t>" (CLOCK_MONOTONIC, so the
// runner can compare with its own clock). It then waits for stdin to close. An agent that
// is told to Restart joins again at once, as a real agent would after stopping its workers.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "muster/v1/rendezvous.grpc.pb.h"

namespace v1 = muster::v1;

namespace {

std::int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Shared {
  std::mutex mu;
  std::condition_variable cv;
  int rounds_wanted = 1;
  int agents_done = 0;                  // agents holding rounds_wanted assignments; guarded by mu
  int agents_failed = 0;                // guarded by mu
  std::int64_t last_assignment_ns = 0;  // guarded by mu
  std::string first_error;              // guarded by mu
};

class SimAgent : public grpc::ClientBidiReactor<v1::AgentMsg, v1::ServerMsg> {
 public:
  SimAgent(v1::Rendezvous::Stub* stub, v1::Join join, Shared* shared)
      : join_(std::move(join)), shared_(shared) {
    stub->async()->Session(&ctx_, this);
    StartRead(&in_);
    StartCall();
  }

  void send_join() {
    v1::AgentMsg msg;
    *msg.mutable_join() = join_;
    write(std::move(msg));
  }

  void cancel() { ctx_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    if (in_.has_assignment()) {
      if (++assignments_ == shared_->rounds_wanted) {
        std::lock_guard<std::mutex> lock(shared_->mu);
        ++shared_->agents_done;
        shared_->last_assignment_ns = std::max(shared_->last_assignment_ns, mono_ns());
        shared_->cv.notify_all();
      }
    } else if (in_.has_restart()) {
      send_join();
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    v1::AgentMsg* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.erase(queue_.begin());
      if (ok && !queue_.empty())
        next = &queue_.front();
      else
        writing_ = false;
    }
    if (next != nullptr) StartWrite(next);
  }

  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
      ++shared_->agents_failed;
      if (shared_->first_error.empty()) shared_->first_error = status.error_message();
      shared_->cv.notify_all();
    }
  }

 private:
  void write(v1::AgentMsg msg) {
    v1::AgentMsg* start = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(msg));
      if (!writing_) {
        writing_ = true;
        start = &queue_.front();
      }
    }
    if (start != nullptr) StartWrite(start);
  }

  grpc::ClientContext ctx_;
  v1::Join join_;
  Shared* shared_;
  v1::ServerMsg in_;
  int assignments_ = 0;  // touched by read reactions only, which never overlap
  std::mutex mu_;
  std::deque<v1::AgentMsg> queue_;  // guarded by mu_
  bool writing_ = false;            // guarded by mu_
};

}  // namespace

int main(int argc, char** argv) {
  std::string target, run_id = "bench", node_prefix = "sim";
  int agents = 1000, channels = 8, min_nodes = 0, max_nodes = 0, nproc = 8, rounds = 1;
  double timeout_s = 60;
  CLI::App app{"rdzv_sim: simulated agents for rendezvous benchmarks"};
  app.add_option("--target", target, "rendezvous server host:port")->required();
  app.add_option("--run_id", run_id);
  app.add_option("--node_prefix", node_prefix, "node ids are <prefix>-<i>");
  app.add_option("--agents", agents)->check(CLI::PositiveNumber);
  app.add_option("--channels", channels)->check(CLI::PositiveNumber);
  app.add_option("--min_nodes", min_nodes, "default: the run's total, --max_nodes");
  app.add_option("--max_nodes", max_nodes, "default: --agents");
  app.add_option("--nproc", nproc)->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "assignments each agent waits for")
      ->check(CLI::PositiveNumber);
  app.add_option("--timeout", timeout_s, "seconds");
  CLI11_PARSE(app, argc, argv);
  if (max_nodes == 0) max_nodes = agents;
  if (min_nodes == 0) min_nodes = max_nodes;

  Shared shared;
  shared.rounds_wanted = rounds;
  std::vector<std::shared_ptr<grpc::Channel>> chans;
  std::vector<std::unique_ptr<v1::Rendezvous::Stub>> stubs;
  for (int c = 0; c < channels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per channel
    chans.push_back(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
    if (!chans.back()->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(30))) {
      std::fprintf(stderr, "rdzv_sim: cannot connect to %s\n", target.c_str());
      return 1;
    }
    stubs.push_back(v1::Rendezvous::NewStub(chans.back()));
  }
  std::vector<std::unique_ptr<SimAgent>> sims;
  for (int i = 0; i < agents; ++i) {
    v1::Join j;
    j.set_run_id(run_id);
    j.set_node_id(node_prefix + "-" + std::to_string(i));
    j.set_host("127.0.0.1");
    j.set_local_world_size(nproc);
    j.set_min_nodes(min_nodes);
    j.set_max_nodes(max_nodes);
    j.set_master_port_candidate(29500);
    j.set_requested_rank(-1);
    j.set_last_call_timeout_ms(100);
    j.set_keep_alive_interval_ms(60000);
    sims.push_back(std::make_unique<SimAgent>(stubs[i % channels].get(), j, &shared));
  }
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  if (!std::getline(std::cin, line) || line != "go") return 1;
  const std::int64_t first = mono_ns();
  for (auto& s : sims) s->send_join();
  {
    std::unique_lock<std::mutex> lock(shared.mu);
    bool ok = shared.cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] {
      return shared.agents_done == agents || shared.agents_failed > 0;
    });
    if (!ok || shared.agents_failed > 0) {
      std::fprintf(stderr, "rdzv_sim: %d of %d agents assigned; %s\n", shared.agents_done, agents,
                   shared.first_error.c_str());
      std::printf("failed\n");
      std::fflush(stdout);
      _exit(1);
    }
    std::printf("first_join_ns %lld last_assignment_ns %lld\n", static_cast<long long>(first),
                static_cast<long long>(shared.last_assignment_ns));
    std::fflush(stdout);
  }
  while (std::getline(std::cin, line)) {
  }
  // Leave without tearing 10,000 streams down one by one.
  _exit(0);
}
