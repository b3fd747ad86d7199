#include "muster/worker/runtime.h"

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
  r.integer("RANK", w.rank);
  r.integer("LOCAL_RANK", w.local_rank);
  r.integer("WORLD_SIZE", w.world_size, 1);
  r.integer("LOCAL_WORLD_SIZE", w.local_world_size, 1);
  r.integer("GROUP_RANK", w.group_rank);
  r.integer("GROUP_WORLD_SIZE", w.group_world_size, 1);
  r.integer("ROLE_RANK", w.role_rank);
  r.integer("ROLE_WORLD_SIZE", w.role_world_size, 1);
  r.str("ROLE_NAME", w.role_name);
  r.str("MASTER_ADDR", w.master_addr);
  r.integer("MASTER_PORT", w.master_port, 1);
  r.integer("TORCHELASTIC_RESTART_COUNT", w.restart_count);
  r.integer("TORCHELASTIC_MAX_RESTARTS", w.max_restarts);
  r.str("TORCHELASTIC_RUN_ID", w.run_id);
  r.str("TORCHELASTIC_ERROR_FILE", w.error_file, false);
  r.str("MUSTER_STORE_ADDR", w.store_addr);
  r.str("MUSTER_RUN_ID", w.store_run_id);
  r.integer("MUSTER_ROUND", w.round, 1);
  r.str("MUSTER_RDZV_TOKEN", w.token, false);
  r.str("MUSTER_NODE_ADDR", w.node_addr, false);
  if (!r.status().ok()) return r.status();
  r.below("RANK", w.rank, "WORLD_SIZE", w.world_size);
  r.below("LOCAL_RANK", w.local_rank, "LOCAL_WORLD_SIZE", w.local_world_size);
  r.below("GROUP_RANK", w.group_rank, "GROUP_WORLD_SIZE", w.group_world_size);
  r.at_most("LOCAL_WORLD_SIZE", w.local_world_size, "WORLD_SIZE", w.world_size);
  r.below("MASTER_PORT", w.master_port, "the port limit", 65536);
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
  if (backend == Backend::kNccl) {
    return make_nccl_communicator(store, info_.rank, info_.world_size, info_.local_rank);
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
  return make_tcp_communicator(store, info_.rank, info_.world_size, opts);
}

}  // namespace muster::worker
