// Simulated agents for the rendezvous benchmarks: N gRPC Session streams over a few
// channels (callback API, no thread per stream) against a real rendezvous server.
//
// Protocol with the runner (bench/run, bench/failover.py): the tool connects every stream,
// prints "ready", waits for a line "go" on stdin, sends every Join, and once each agent holds
// `--rounds` assignments prints "first_join_ns <t> last_assignment_ns <t>" (CLOCK_MONOTONIC, so
// the runner can compare with its own clock). It then waits for stdin to close. An agent that
// is told to Restart joins again at once, as a real agent would after stopping its workers.
//
// With --reattach LIST (replicas: bench/failover.py), an agent whose stream ends after it holds
// its rounds re-attaches as a real agent does when its workers keep running: a new stream to
// the next endpoint of LIST (the one after --target first), whose first message is a Join with
// reattach_round / reattach_group_rank of its last Assignment. A stream that ends before its
// Attached (a dead endpoint refuses at once; a standby that is not to lead ends it UNAVAILABLE)
// is tried again on the next endpoint after --retry_pause_ms. Once every agent got Attached{ok}
// the tool prints "first_loss_ns <t> last_attached_ns <t> retries <n>" (n: streams that ended
// before their Attached, over all agents); an Attached{ok = false} prints "failed". One
// failover per run of the tool.
//
// With --keep_alive_ms P --hold_s S (the cost of keep-alives: bench/run's keepalive rows), once
// the rounds are held every agent sends a keep-alive every P ms for S seconds, as an idle
// agent in a round does, and the tool prints "keep_alives_sent <n> answered <m> start_ns <t>
// end_ns <t>" (the server answers each one); "hold_start" and "hold_end" lines mark the hold, for
// the runner to read the server's CPU time at each.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <queue>
#include <sstream>
#include <string>
#include <thread>
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
  // Re-attach (--reattach), guarded by mu.
  int reattached = 0;
  int retries = 0;
  std::int64_t first_loss_ns = 0;
  std::int64_t last_attached_ns = 0;
  std::atomic<std::int64_t> keep_alives_answered{0};

  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    ++agents_failed;
    if (first_error.empty()) first_error = why;
    cv.notify_all();
  }
};

class SimAgent;

// Opens an agent's next stream from a thread of its own, at a given time: a stream's end is
// seen on a gRPC callback thread, which must not wait out the pause.
class Opener {
 public:
  Opener() : thread_([this] { loop(); }) {}
  void at(std::int64_t due_ns, SimAgent* agent) {
    std::lock_guard<std::mutex> lock(mu_);
    due_.push({due_ns, agent});
    cv_.notify_one();
  }

 private:
  using Entry = std::pair<std::int64_t, SimAgent*>;
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> due_;  // guarded by mu_
  std::thread thread_;  // never joined: the tool leaves by _exit
};

// One stream. Its reactions forward to its agent. A Call is never deleted (the tool leaves
// by _exit), so the agent may still write to one whose stream just ended without a lock held
// across gRPC calls.
class Call : public grpc::ClientBidiReactor<v1::AgentMsg, v1::ServerMsg> {
 public:
  Call(v1::Rendezvous::Stub* stub, SimAgent* agent, const v1::AgentMsg* first) : agent_(agent) {
    stub->async()->Session(&ctx_, this);
    StartRead(&in_);
    if (first != nullptr) write(*first);
    StartCall();
  }

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

  void OnReadDone(bool ok) override;
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
  void OnDone(const grpc::Status& status) override;

 private:
  grpc::ClientContext ctx_;
  SimAgent* agent_;
  v1::ServerMsg in_;
  std::mutex mu_;
  std::deque<v1::AgentMsg> queue_;  // guarded by mu_
  bool writing_ = false;            // guarded by mu_
};

struct Config {
  // channels[e][c], stubs[e][c]: channel c of endpoint e; endpoint 0 is --target.
  std::vector<std::vector<std::shared_ptr<grpc::Channel>>> channels;
  std::vector<std::vector<std::unique_ptr<v1::Rendezvous::Stub>>> stubs;
  std::vector<int> reattach_order;  // endpoint indexes an agent cycles through on re-attach
  std::chrono::milliseconds retry_pause{50};
  Opener* opener = nullptr;
};

class SimAgent {
 public:
  SimAgent(int index, v1::Join join, Shared* shared, const Config* cfg)
      : index_(index), join_(std::move(join)), shared_(shared), cfg_(cfg) {
    call_ = new Call(stub(0), this, nullptr);
  }

  void send_join() {
    v1::AgentMsg msg;
    *msg.mutable_join() = join_;
    Call* c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = call_;
    }
    c->write(std::move(msg));
  }

  void send_keep_alive() {
    v1::AgentMsg msg;
    msg.mutable_keep_alive();
    Call* c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = call_;
    }
    c->write(std::move(msg));
  }

  // A new stream to the current re-attach endpoint (from the Opener's thread).
  void open_reattach() {
    v1::AgentMsg msg;
    int ep;
    {
      std::lock_guard<std::mutex> lock(mu_);
      *msg.mutable_join() = join_;
      msg.mutable_join()->set_reattach_round(round_);
      msg.mutable_join()->set_reattach_group_rank(group_rank_);
      ep = cfg_->reattach_order[static_cast<std::size_t>(at_)];
    }
    Call* c = new Call(stub(ep), this, &msg);
    std::lock_guard<std::mutex> lock(mu_);
    call_ = c;
  }

  // Reactions of the agent's current stream (reads never overlap, and OnDone comes last).
  void on_message(Call* from, const v1::ServerMsg& m) {
    if (m.has_assignment()) {
      bool done = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        round_ = m.assignment().round();
        group_rank_ = m.assignment().group_rank();
        if (++assignments_ == shared_->rounds_wanted) {
          state_ = State::kHolding;
          done = true;
        }
      }
      if (done) {
        std::lock_guard<std::mutex> lock(shared_->mu);
        ++shared_->agents_done;
        shared_->last_assignment_ns = std::max(shared_->last_assignment_ns, mono_ns());
        shared_->cv.notify_all();
      }
    } else if (m.has_keep_alive()) {
      shared_->keep_alives_answered.fetch_add(1, std::memory_order_relaxed);
    } else if (m.has_restart()) {
      v1::AgentMsg msg;
      *msg.mutable_join() = join_;
      from->write(std::move(msg));
    } else if (m.has_attached()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != State::kReattaching) return;
        state_ = State::kReattached;
      }
      if (!m.attached().ok()) {
        shared_->fail(join_.node_id() + ": not re-attached: " + m.attached().reason());
        return;
      }
      std::lock_guard<std::mutex> lock(shared_->mu);
      ++shared_->reattached;
      shared_->last_attached_ns = std::max(shared_->last_attached_ns, mono_ns());
      shared_->cv.notify_all();
    }
  }

  void on_done(const grpc::Status& status) {
    State was;
    {
      std::lock_guard<std::mutex> lock(mu_);
      was = state_;
      if (was == State::kHolding && !cfg_->reattach_order.empty()) {
        state_ = State::kReattaching;
        at_ = first_reattach_index();
      } else if (was == State::kReattaching) {
        at_ = (at_ + 1) % static_cast<int>(cfg_->reattach_order.size());
      }
    }
    const std::int64_t now = mono_ns();
    if (was == State::kJoining) {
      if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED)
        shared_->fail(status.error_message());
    } else if (was == State::kHolding && !cfg_->reattach_order.empty()) {
      {
        std::lock_guard<std::mutex> lock(shared_->mu);
        if (shared_->first_loss_ns == 0) shared_->first_loss_ns = now;
      }
      cfg_->opener->at(now, this);  // at once, as a real agent does
    } else if (was == State::kReattaching) {
      {
        std::lock_guard<std::mutex> lock(shared_->mu);
        ++shared_->retries;
      }
      cfg_->opener->at(now + std::chrono::nanoseconds(cfg_->retry_pause).count(), this);
    }
  }

 private:
  enum class State { kJoining, kHolding, kReattaching, kReattached };
  v1::Rendezvous::Stub* stub(int endpoint) const {
    const auto& chans = cfg_->stubs[static_cast<std::size_t>(endpoint)];
    return chans[static_cast<std::size_t>(index_) % chans.size()].get();
  }
  // The endpoint after --target in the re-attach order (the first when it is not there).
  int first_reattach_index() const {
    const auto& order = cfg_->reattach_order;
    auto it = std::find(order.begin(), order.end(), 0);
    if (it == order.end()) return 0;
    return static_cast<int>((it - order.begin() + 1) % static_cast<long>(order.size()));
  }

  const int index_;
  const v1::Join join_;
  Shared* shared_;
  const Config* cfg_;
  std::mutex mu_;
  Call* call_ = nullptr;             // guarded by mu_
  State state_ = State::kJoining;    // guarded by mu_
  int assignments_ = 0;              // guarded by mu_
  int round_ = 0, group_rank_ = -1;  // of the last Assignment; guarded by mu_
  int at_ = 0;                       // index into reattach_order; guarded by mu_
};

void Call::OnReadDone(bool ok) {
  if (!ok) return;  // OnDone follows
  agent_->on_message(this, in_);
  StartRead(&in_);
}

void Call::OnDone(const grpc::Status& status) { agent_->on_done(status); }

void Opener::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (due_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const Entry next = due_.top();
    const std::int64_t now = mono_ns();
    if (next.first > now) {
      cv_.wait_for(lock, std::chrono::nanoseconds(next.first - now));
      continue;
    }
    due_.pop();
    lock.unlock();
    next.second->open_reattach();
    lock.lock();
  }
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::vector<std::shared_ptr<grpc::Channel>> make_channels(const std::string& target,
                                                          int channels) {
  std::vector<std::shared_ptr<grpc::Channel>> out;
  for (int c = 0; c < channels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per channel
    // Reconnect backoff as the agents' channels have it (100 ms first, at most 1 s).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    out.push_back(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string target, run_id = "bench", node_prefix = "sim", reattach;
  int agents = 1000, channels = 8, min_nodes = 0, max_nodes = 0, nproc = 8, rounds = 1;
  int retry_pause_ms = 50, keep_alive_ms = 0;
  double timeout_s = 60, hold_s = 0;
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
  app.add_option("--timeout", timeout_s,
                 "seconds: for the rounds after go, and for a re-attach after the first loss");
  app.add_option("--reattach", reattach,
                 "HOST:PORT,...: re-attach there when a stream ends after the rounds are held");
  app.add_option("--retry_pause_ms", retry_pause_ms,
                 "pause before a re-attach stream that ended early is tried on the next endpoint")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--keep_alive_ms", keep_alive_ms,
                 "after the rounds: each agent sends a keep-alive this often, for --hold_s")
      ->check(CLI::PositiveNumber);
  app.add_option("--hold_s", hold_s, "seconds of keep-alives (with --keep_alive_ms)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (max_nodes == 0) max_nodes = agents;
  if (min_nodes == 0) min_nodes = max_nodes;

  Shared shared;
  shared.rounds_wanted = rounds;
  Config cfg;
  cfg.retry_pause = std::chrono::milliseconds(retry_pause_ms);
  std::vector<std::string> endpoints = {target};
  for (const std::string& e : split_commas(reattach)) {
    auto it = std::find(endpoints.begin(), endpoints.end(), e);
    cfg.reattach_order.push_back(static_cast<int>(it - endpoints.begin()));
    if (it == endpoints.end()) endpoints.push_back(e);
  }
  for (const std::string& e : endpoints) {
    cfg.channels.push_back(make_channels(e, channels));
    cfg.stubs.emplace_back();
    for (const auto& ch : cfg.channels.back()) cfg.stubs.back().push_back(v1::Rendezvous::NewStub(ch));
  }
  // Every connection to --target up before the streams (the others connect when used).
  for (const auto& ch : cfg.channels[0]) {
    if (!ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30))) {
      std::fprintf(stderr, "rdzv_sim: cannot connect to %s\n", target.c_str());
      return 1;
    }
  }
  Opener opener;
  cfg.opener = &opener;
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
    sims.push_back(std::make_unique<SimAgent>(i, j, &shared, &cfg));
  }
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  if (!std::getline(std::cin, line) || line != "go") return 1;
  const std::int64_t first = mono_ns();
  for (auto& s : sims) s->send_join();
  auto give_up = [&](int done, const char* what) {
    std::fprintf(stderr, "rdzv_sim: %d of %d agents %s; %s\n", done, agents, what,
                 shared.first_error.c_str());
    std::printf("failed\n");
    std::fflush(stdout);
    _exit(1);
  };
  {
    std::unique_lock<std::mutex> lock(shared.mu);
    bool ok = shared.cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] {
      return shared.agents_done == agents || shared.agents_failed > 0;
    });
    if (!ok || shared.agents_failed > 0) give_up(shared.agents_done, "assigned");
    std::printf("first_join_ns %lld last_assignment_ns %lld\n", static_cast<long long>(first),
                static_cast<long long>(shared.last_assignment_ns));
    std::fflush(stdout);
  }
  if (keep_alive_ms > 0 && hold_s > 0) {
    // Each agent's keep-alives at its own phase of the period, as independent agents send
    // them: on each 1 ms tick, the agents whose turn has come.
    const std::int64_t start = mono_ns();
    const auto period = std::chrono::milliseconds(keep_alive_ms);
    const auto t0 = std::chrono::steady_clock::now();
    const auto end = t0 + std::chrono::duration<double>(hold_s);
    std::int64_t sent = 0;
    std::printf("hold_start\n");
    std::fflush(stdout);
    for (auto tick = t0; tick < end; tick += std::chrono::milliseconds(1)) {
      std::this_thread::sleep_until(tick);
      const double periods = std::chrono::duration<double>(tick - t0) / period;
      const auto due = static_cast<std::int64_t>(periods * static_cast<double>(agents)) + 1;
      for (; sent < due; ++sent) sims[static_cast<std::size_t>(sent % agents)]->send_keep_alive();
    }
    const std::int64_t stop = mono_ns();
    std::printf("hold_end\n");
    std::fflush(stdout);
    // The answers still in flight: at most one period more.
    std::this_thread::sleep_for(period);
    std::printf("keep_alives_sent %lld answered %lld start_ns %lld end_ns %lld\n",
                static_cast<long long>(sent),
                static_cast<long long>(shared.keep_alives_answered.load()),
                static_cast<long long>(start), static_cast<long long>(stop));
    std::fflush(stdout);
  }
  if (!cfg.reattach_order.empty()) {
    // stdin's end still ends the tool while it waits for a failover.
    std::thread([] {
      std::string rest;
      while (std::getline(std::cin, rest)) {
      }
      _exit(0);
    }).detach();
    std::unique_lock<std::mutex> lock(shared.mu);
    const auto limit = std::chrono::duration<double>(timeout_s);
    for (;;) {
      if (shared.agents_failed > 0) give_up(shared.reattached, "re-attached");
      if (shared.reattached == agents) break;
      if (shared.first_loss_ns != 0 &&
          std::chrono::nanoseconds(mono_ns() - shared.first_loss_ns) > limit)
        give_up(shared.reattached, "re-attached in time");
      shared.cv.wait_for(lock, std::chrono::milliseconds(100));
    }
    std::printf("first_loss_ns %lld last_attached_ns %lld retries %d\n",
                static_cast<long long>(shared.first_loss_ns),
                static_cast<long long>(shared.last_attached_ns), shared.retries);
    std::fflush(stdout);
  }
  while (std::getline(std::cin, line)) {
  }
  // Leave without tearing 10,000 streams down one by one.
  _exit(0);
}
