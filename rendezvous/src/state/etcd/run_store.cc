// The leader's RunStore on etcd: the layout of etcd_layout.h, every write fenced on the
// leader's election key (client.h).
#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "state/etcd/etcd_client.h"
#include "muster/rendezvous/etcd_layout.h"
#include "muster/rendezvous/limits.h"

namespace muster::rendezvous::etcd {
namespace {

namespace layout = etcd_layout;

class EtcdRunStore final : public RunStore {
 public:
  EtcdRunStore(std::shared_ptr<Stubs> stubs, std::string prefix,
               std::chrono::milliseconds timeout, std::string fence_key, std::int64_t fence_rev)
      : s_(std::move(stubs)),
        prefix_(std::move(prefix)),
        timeout_(timeout),
        fence_key_(std::move(fence_key)),
        fence_rev_(fence_rev) {}

  absl::StatusOr<Loaded> load_all() override {
    std::map<std::string, std::string> kvs;
    const std::string begin = layout::runs_prefix(prefix_);
    const std::string end = layout::prefix_end(begin);
    std::string from = begin;
    const auto deadline = std::chrono::system_clock::now() + timeout_;
    for (;;) {
      etcdserverpb::RangeRequest req;
      req.set_key(from);
      req.set_range_end(end);
      req.set_limit(limits::kEtcdRangePage);
      etcdserverpb::RangeResponse resp;
      grpc::Status st = call_with_retry(deadline, s_->attempt, [&](grpc::ClientContext& ctx) {
        return s_->kv->Range(&ctx, req, &resp);
      });
      if (!st.ok()) return error(*s_, "reading the runs", st);
      for (const auto& kv : resp.kvs()) kvs[kv.key()] = kv.value();
      if (!resp.more() || resp.kvs().empty()) break;
      from = resp.kvs(resp.kvs_size() - 1).key() + std::string(1, '\0');
    }
    layout::Joined joined = layout::join(prefix_, kvs);
    next_generation_ = std::max(next_generation_, joined.max_generation + 1);
    Loaded out;
    out.skipped = std::move(joined.skipped);
    for (std::size_t i = 0; i < joined.records.size(); ++i) {
      const v1::RunRecord& r = joined.records[i];
      written_[r.run_id()] = Written{joined.generations[i], layout::split(r).nodes};
    }
    out.records = std::move(joined.records);
    return out;
  }

  absl::Status put(const v1::RunRecord& record) override {
    layout::Split split = layout::split(record);
    const std::string& id = record.run_id();
    auto it = written_.find(id);
    std::vector<etcdserverpb::RequestOp> ops;
    std::int64_t generation;
    if (it != written_.end() && it->second.nodes == split.nodes) {
      generation = it->second.generation;  // the same nodes: only the head changes
    } else {
      // A generation no key has had (above any a leader that died mid-write left), then as
      // many transactions of node keys as it takes; the head comes last.
      generation = next_generation_++;
      const std::string gen = layout::generation_prefix(prefix_, id, generation);
      std::vector<std::vector<etcdserverpb::RequestOp>> batches;
      std::size_t bytes = 0;
      for (std::size_t i = 0; i < split.nodes.size(); ++i) {
        std::string key = layout::node_key(prefix_, id, generation, static_cast<int>(i));
        const std::size_t size = key.size() + split.nodes[i].size() + 16;
        if (static_cast<int>(ops.size()) >= limits::kEtcdMaxOpsPerTxn ||
            bytes + size > limits::kEtcdMaxTxnBytes) {
          batches.push_back(std::move(ops));
          ops.clear();
          bytes = 0;
        }
        bytes += size;
        ops.push_back(put_op(std::move(key), split.nodes[i]));
      }
      if (static_cast<int>(ops.size()) + 3 > limits::kEtcdMaxOpsPerTxn) {
        batches.push_back(std::move(ops));
        ops.clear();
      }
      // The node keys' transactions touch keys no reader looks at yet (the head does not
      // name their generation): they go together, and the head after all of them.
      if (absl::Status st = commit_all(batches, "writing a round's node keys"); !st.ok()) {
        written_.erase(id);
        return st;
      }
      // Every other generation of the run goes with the head that stops naming it.
      const std::string run = layout::run_prefix(prefix_, id);
      ops.push_back(delete_range(run + "g", gen));
      ops.push_back(delete_range(layout::prefix_end(gen), run + "h"));
    }
    split.head.set_generation(generation);
    ops.push_back(put_op(layout::head_key(prefix_, id), split.head.SerializeAsString()));
    if (absl::Status st = commit(ops, "writing a run"); !st.ok()) {
      written_.erase(id);
      return st;
    }
    written_[id] = Written{generation, std::move(split.nodes)};
    return absl::OkStatus();
  }

  absl::Status erase(const std::string& run_id) override {
    written_.erase(run_id);
    const std::string run = layout::run_prefix(prefix_, run_id);
    return commit({delete_range(run, layout::prefix_end(run))}, "removing a run");
  }

 private:
  struct Written {
    std::int64_t generation = 0;
    std::vector<std::string> nodes;
  };

  static etcdserverpb::RequestOp put_op(std::string key, const std::string& value) {
    etcdserverpb::RequestOp op;
    op.mutable_request_put()->set_key(std::move(key));
    op.mutable_request_put()->set_value(value);
    return op;
  }
  static etcdserverpb::RequestOp delete_range(std::string key, std::string end) {
    etcdserverpb::RequestOp op;
    op.mutable_request_delete_range()->set_key(std::move(key));
    op.mutable_request_delete_range()->set_range_end(std::move(end));
    return op;
  }

  // A transaction of `ops` that applies only while this replica leads: its election key is
  // the one it created.
  etcdserverpb::TxnRequest fenced(const std::vector<etcdserverpb::RequestOp>& ops) const {
    etcdserverpb::TxnRequest req;
    etcdserverpb::Compare* c = req.add_compare();
    c->set_key(fence_key_);
    c->set_target(etcdserverpb::Compare::CREATE);
    c->set_result(etcdserverpb::Compare::EQUAL);
    c->set_create_revision(fence_rev_);
    for (const auto& op : ops) *req.add_success() = op;
    return req;
  }

  absl::Status outcome(const grpc::Status& st, const etcdserverpb::TxnResponse& resp,
                       const char* what) const {
    if (!st.ok()) return error(*s_, what, st);
    if (!resp.succeeded()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "etcd at ", s_->endpoints, ": ", what,
          ": this rdzvd no longer leads (its election key is gone: its lease expired)"));
    }
    return absl::OkStatus();
  }

  // One fenced transaction, retried on another member (client.h).
  absl::Status commit(const std::vector<etcdserverpb::RequestOp>& ops, const char* what) {
    const etcdserverpb::TxnRequest req = fenced(ops);
    etcdserverpb::TxnResponse resp;
    grpc::Status st = call_with_retry(
        std::chrono::system_clock::now() + timeout_, s_->attempt,
        [&](grpc::ClientContext& ctx) { return s_->kv->Txn(&ctx, req, &resp); });
    return outcome(st, resp, what);
  }

  // Independent fenced transactions, up to limits::kEtcdConcurrentTxns in flight at once (etcd
  // batches concurrent proposals into one raft round and one WAL sync); one that could not
  // reach etcd in its attempt is tried again alone.
  absl::Status commit_all(const std::vector<std::vector<etcdserverpb::RequestOp>>& batches,
                          const char* what) {
    struct Call {
      grpc::ClientContext ctx;
      etcdserverpb::TxnRequest req;
      etcdserverpb::TxnResponse resp;
      grpc::Status st;
    };
    const auto deadline = std::chrono::system_clock::now() + timeout_;
    for (std::size_t from = 0; from < batches.size(); from += limits::kEtcdConcurrentTxns) {
      const std::size_t to = std::min(batches.size(), from + limits::kEtcdConcurrentTxns);
      std::vector<std::unique_ptr<Call>> calls;
      std::mutex mu;
      std::condition_variable cv;
      std::size_t done = 0;
      for (std::size_t i = from; i < to; ++i) {
        calls.push_back(std::make_unique<Call>());
        Call* c = calls.back().get();
        c->req = fenced(batches[i]);
        c->ctx.set_deadline(std::min(deadline, std::chrono::system_clock::now() + s_->attempt));
        s_->kv->async()->Txn(&c->ctx, &c->req, &c->resp, [&, c](grpc::Status st) {
          std::lock_guard<std::mutex> lock(mu);
          c->st = std::move(st);
          ++done;
          cv.notify_all();
        });
      }
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return done == calls.size(); });
      }
      for (auto& c : calls) {
        if (try_again(c->st) && std::chrono::system_clock::now() < deadline) {
          c->st = call_with_retry(deadline, s_->attempt, [&](grpc::ClientContext& ctx) {
            return s_->kv->Txn(&ctx, c->req, &c->resp);
          });
        }
        if (absl::Status st = outcome(c->st, c->resp, what); !st.ok()) return st;
      }
    }
    return absl::OkStatus();
  }

  std::shared_ptr<Stubs> s_;
  const std::string prefix_;
  const std::chrono::milliseconds timeout_;
  const std::string fence_key_;
  const std::int64_t fence_rev_;
  std::int64_t next_generation_ = 1;
  std::map<std::string, Written> written_;  // what etcd holds of each run, as last written
};

}  // namespace

std::shared_ptr<RunStore> make_run_store(std::shared_ptr<Stubs> stubs, std::string prefix,
                                         std::chrono::milliseconds timeout, std::string fence_key,
                                         std::int64_t fence_revision) {
  return std::make_shared<EtcdRunStore>(std::move(stubs), std::move(prefix), timeout,
                                        std::move(fence_key), fence_revision);
}

}  // namespace muster::rendezvous::etcd
