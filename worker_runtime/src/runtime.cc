#include "muster/worker/runtime.h"

#include "muster/ops/worker_env_names.h"

#include <cstdlib>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/prefix_store.h"
#include "muster/worker/comm/nccl_communicator.h"
#include "muster/worker/comm/tcp_communicator.h"

extern char** environ;

namespace muster::worker {
namespace {

class EnvReader {
 public:
  explicit EnvReader(const std::map<std::string, std::string>& env) : env_(env) {}

  void str(const char* key, std::string& out, bool required = true) {
    auto it = env_.find(key);
    if (it == env_.end() || it->second.empty()) {
      if (required) fail(absl::StrCat(key, " is not set (is this program running under launch?)"));
      return;
    }
    out = it->second;
  }
  void integer(const char* key, int& out, int min = 0) {
    std::string v;
    str(key, v);
    if (v.empty()) return;
    if (!absl::SimpleAtoi(v, &out) || out < min) {
      fail(absl::StrCat(key, "='", v, "' is not an integer of at least ", min));
    }
  }
  void below(const char* key, int value, const char* limit_key, int limit) {
    if (value >= limit) fail(absl::StrCat(key, "=", value, " is not below ", limit_key, "=", limit));
  }
  // The message names the value as given (not value - 1, as a below() check would).
  void at_most(const char* key, int value, const char* limit_key, int limit) {
    if (value > limit) {
      fail(absl::StrCat(key, "=", value, " is above ", limit_key, "=", limit));
    }
  }
  const absl::Status& status() const { return status_; }

 private:
  void fail(std::string msg) {
    if (status_.ok()) status_ = absl::InvalidArgumentError("worker environment: " + msg);
  }
  const std::map<std::string, std::string>& env_;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<WorkerInfo> parse_worker_env(const std::map<std::string, std::string>& env) {
  WorkerInfo w;
  EnvReader r(env);
  r.integer(env::kRank, w.rank);
  r.integer(env::kLocalRank, w.local_rank);
  r.integer(env::kWorldSize, w.world_size, 1);
  r.integer(env::kLocalWorldSize, w.local_world_size, 1);
  r.integer(env::kGroupRank, w.group_rank);
  r.integer(env::kGroupWorldSize, w.group_world_size, 1);
  r.integer(env::kRoleRank, w.role_rank);
  r.integer(env::kRoleWorldSize, w.role_world_size, 1);
  r.str(env::kRoleName, w.role_name);
  r.str(env::kMasterAddr, w.master_addr);
  r.integer(env::kMasterPort, w.master_port, 1);
  r.integer(env::kRestartCount, w.restart_count);
  r.integer(env::kMaxRestarts, w.max_restarts);
  r.str(env::kRunId, w.run_id);
  r.str(env::kErrorFile, w.error_file, false);
  r.str(env::kStoreAddr, w.store_addr);
  r.str(env::kStoreRunId, w.store_run_id);
  r.integer(env::kRound, w.round, 1);
  r.str(env::kRdzvToken, w.token, false);
  r.str(env::kNodeAddr, w.node_addr, false);
  if (env.count(env::kControlFd) > 0) r.integer(env::kControlFd, w.control_fd, 3);
  if (!r.status().ok()) return r.status();
  r.below(env::kRank, w.rank, env::kWorldSize, w.world_size);
  r.below(env::kLocalRank, w.local_rank, env::kLocalWorldSize, w.local_world_size);
  r.below(env::kGroupRank, w.group_rank, env::kGroupWorldSize, w.group_world_size);
  r.at_most(env::kLocalWorldSize, w.local_world_size, env::kWorldSize, w.world_size);
  r.below(env::kMasterPort, w.master_port, "the port limit", 65536);
  if (!r.status().ok()) return r.status();
  if (w.node_addr.empty()) w.node_addr = w.master_addr;
  w.tls = rendezvous::client_tls_files_from_env(env);
  return w;
}

Runtime::Runtime(WorkerInfo info, ProgressReporter progress, rendezvous::ClientTls tls)
    : info_(std::move(info)), progress_(std::move(progress)) {
  rendezvous::GrpcStoreOptions store;
  store.target = info_.store_addr;
  store.run_id = info_.store_run_id;
  store.token = info_.token;
  store.tls = std::move(tls);
  run_store_ = std::make_unique<rendezvous::GrpcStore>(std::move(store));
  round_store_ = std::make_unique<rendezvous::PrefixStore>(absl::StrCat("r", info_.round, "/"),
                                                           *run_store_);
  if (info_.control_fd >= 0) control_ = std::make_unique<ControlChannel>(info_.control_fd);
}

namespace {

// A communicator the control channel aborts while it lives (control.h).
class WatchedCommunicator final : public Communicator {
 public:
  WatchedCommunicator(std::unique_ptr<Communicator> inner, ControlChannel& control)
      : inner_(std::move(inner)), control_(control) {
    control_.watch(inner_.get());
  }
  ~WatchedCommunicator() override { control_.forget(inner_.get()); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  absl::Status all_reduce(void* d, std::size_t n, DType t, ReduceOp op, void* s) override {
    return inner_->all_reduce(d, n, t, op, s);
  }
  absl::Status broadcast(void* d, std::size_t n, DType t, int root, void* s) override {
    return inner_->broadcast(d, n, t, root, s);
  }
  absl::Status all_gather(const void* a, void* b, std::size_t n, DType t, void* s) override {
    return inner_->all_gather(a, b, n, t, s);
  }
  absl::Status reduce_scatter(const void* a, void* b, std::size_t n, DType t, ReduceOp op,
                              void* s) override {
    return inner_->reduce_scatter(a, b, n, t, op, s);
  }
  absl::Status barrier() override { return inner_->barrier(); }
  void abort() override { inner_->abort(); }

 private:
  std::unique_ptr<Communicator> inner_;
  ControlChannel& control_;
};

}  // namespace

absl::Status Runtime::enable_in_place() {
  if (control_ == nullptr) {
    return absl::FailedPreconditionError(
        "in-place recovery: no control channel (run under launch --in_place)");
  }
  if (in_place_) return absl::OkStatus();
  if (absl::Status s = control_->send_hello(); !s.ok()) return s;
  in_place_ = true;
  return absl::OkStatus();
}

absl::StatusOr<WorkerInfo> Runtime::await_world(std::chrono::milliseconds timeout) {
  if (!in_place_) return absl::FailedPreconditionError("in-place recovery is not enabled");
  auto w = control_->await_world(timeout);
  if (!w.ok()) return w.status();
  info_.round = w->round;
  info_.rank = w->rank;
  info_.world_size = w->world_size;
  info_.local_rank = w->local_rank;
  info_.local_world_size = w->local_world_size;
  info_.group_rank = w->group_rank;
  info_.group_world_size = w->group_world_size;
  info_.role_rank = w->rank;
  info_.role_world_size = w->world_size;
  info_.restart_count = w->restart_count;
  info_.lost = w->lost;
  world_epoch_ = w->epoch;
  if (!w->master_addr.empty()) info_.master_addr = w->master_addr;
  if (w->master_port > 0) info_.master_port = w->master_port;
  round_store_ = std::make_unique<rendezvous::PrefixStore>(absl::StrCat("r", info_.round, "/"),
                                                           *run_store_);
  communicators_made_ = 0;
  return info_;
}

absl::Status Runtime::resumed() {
  if (!in_place_ || resumed_round_ == info_.round) return absl::OkStatus();
  resumed_round_ = info_.round;
  return control_->send_resumed(info_.round);
}

Runtime::~Runtime() = default;

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::from_env(
    const std::map<std::string, std::string>& env) {
  auto info = parse_worker_env(env);
  if (!info.ok()) return info.status();
  auto tls = rendezvous::load_client_tls(info->tls);
  if (!tls.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker environment (MUSTER_TLS_*): ", tls.status().message()));
  }
  return std::unique_ptr<Runtime>(
      new Runtime(std::move(*info), ProgressReporter::from_env(env), std::move(*tls)));
}

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::from_env() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return from_env(env);
}

absl::StatusOr<std::unique_ptr<Communicator>> Runtime::communicator(Backend backend) {
  // Each communicator of this round gets its own keys.
  rendezvous::PrefixStore store(absl::StrCat("comm", communicators_made_++, "/"), *round_store_);
  if (backend == Backend::kAuto) {
    backend = nccl_available() && cuda_device_count() > 0 ? Backend::kNccl : Backend::kTcp;
  }
  auto watched = [this](absl::StatusOr<std::unique_ptr<Communicator>> c)
      -> absl::StatusOr<std::unique_ptr<Communicator>> {
    if (!c.ok() || control_ == nullptr) return c;
    return std::unique_ptr<Communicator>(new WatchedCommunicator(std::move(*c), *control_));
  };
  if (backend == Backend::kNccl) {
    return watched(make_nccl_communicator(store, info_.rank, info_.world_size, info_.local_rank));
  }
  TcpOptions opts;
  opts.advertise_host = info_.node_addr;
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0 && static_cast<unsigned>(info_.local_world_size) > cores) {
    opts.recv_low_water = 1 << 20;  // more ranks than cores here (see TcpOptions)
  }
  if (const char* v = std::getenv("MUSTER_RING_UNIX"); v != nullptr && std::string(v) == "0") {
    opts.same_host_unix = false;  // TCP between every pair, also on one machine
  }
  if (control_ != nullptr) {
    // An abort or a new world since this world's message ends the set-up (abort() reaches
    // only made rings). Since the message, not since this call: an abort and the next world
    // that came between await_world() and here would otherwise leave this ring waiting for a
    // peer that is gone, with nothing left to cancel it.
    ControlChannel* control = control_.get();
    const std::uint64_t epoch = world_epoch_;
    opts.cancelled = [control, epoch] { return control->epoch() != epoch; };
  }
  return watched(make_tcp_communicator(store, info_.rank, info_.world_size, opts));
}

}  // namespace muster::worker
