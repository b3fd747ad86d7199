#include "muster/rendezvous/grpc_store.h"


#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {

using Op = v1::StoreRequest::Op;

class GrpcStore::Impl {
 public:
  explicit Impl(GrpcStoreOptions o) : opts(std::move(o)) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(16 << 20);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    args.SetString(GRPC_ARG_OPTIMIZATION_TARGET, "latency");
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    stub = v1::Store::NewStub(
        grpc::CreateCustomChannel(opts.target, grpc::InsecureChannelCredentials(), args));
  }

  // An open stream; one request at a time.
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StoreRequest, v1::StoreReply>> rw;
  };

  // One request on a free stream (a new one when all are busy, e.g. another thread waits on
  // a key this thread is about to set). A stream that breaks is dropped.
  absl::StatusOr<v1::StoreReply> call(Op op, std::vector<std::string> keys,
                                      std::vector<std::string> values = {},
                                      std::int64_t delta = 0,
                                      std::chrono::milliseconds wait = {}) {
    v1::StoreRequest req;
    req.set_run_id(opts.run_id);
    req.set_token(opts.token);
    req.set_op(op);
    for (auto& k : keys) req.add_keys(std::move(k));
    for (auto& v : values) req.add_values(std::move(v));
    req.set_delta(delta);
    req.set_timeout_ms(wait.count());
    std::unique_ptr<Stream> s = acquire();
    v1::StoreReply reply;
    if (!s->rw->Write(req) || !s->rw->Read(&reply)) {
      grpc::Status st = s->rw->Finish();
      return absl::UnavailableError(absl::StrCat(
          "store: lost the connection to ", opts.target,
          st.ok() ? std::string() : absl::StrCat(": ", st.error_message())));
    }
    release(std::move(s));
    if (reply.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.error());
    }
    return reply;
  }

  std::unique_ptr<Stream> acquire() {
    {
      absl::MutexLock lock(&mu);
      if (!free.empty()) {
        auto s = std::move(free.back());
        free.pop_back();
        return s;
      }
    }
    auto s = std::make_unique<Stream>();
    s->rw = stub->Stream(&s->ctx);
    return s;
  }

  void release(std::unique_ptr<Stream> s) {
    absl::MutexLock lock(&mu);
    free.push_back(std::move(s));
  }

  ~Impl() {
    absl::MutexLock lock(&mu);
    for (auto& s : free) {
      s->rw->WritesDone();
      s->rw->Finish();
    }
  }

  GrpcStoreOptions opts;
  std::unique_ptr<v1::Store::Stub> stub;
  absl::Mutex mu;
  std::vector<std::unique_ptr<Stream>> free ABSL_GUARDED_BY(mu);
};

GrpcStore::GrpcStore(GrpcStoreOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
GrpcStore::~GrpcStore() = default;

absl::Status GrpcStore::set(const std::string& key, const std::string& value) {
  return impl_->call(v1::StoreRequest::SET, {key}, {value}).status();
}

absl::StatusOr<std::string> GrpcStore::get(const std::string& key, Duration timeout) {
  auto r = impl_->call(v1::StoreRequest::GET, {key}, {}, 0, timeout);
  if (!r.ok()) return r.status();
  return r->values(0);
}

absl::StatusOr<std::int64_t> GrpcStore::add(const std::string& key, std::int64_t delta) {
  auto r = impl_->call(v1::StoreRequest::ADD, {key}, {}, delta);
  if (!r.ok()) return r.status();
  return r->number();
}

absl::StatusOr<std::string> GrpcStore::compare_set(const std::string& key,
                                                   const std::string& expected,
                                                   const std::string& desired) {
  auto r = impl_->call(v1::StoreRequest::COMPARE_SET, {key}, {expected, desired});
  if (!r.ok()) return r.status();
  return r->values(0);
}

absl::StatusOr<bool> GrpcStore::delete_key(const std::string& key) {
  auto r = impl_->call(v1::StoreRequest::DELETE, {key});
  if (!r.ok()) return r.status();
  return r->flag();
}

absl::StatusOr<bool> GrpcStore::check(const std::vector<std::string>& keys) {
  auto r = impl_->call(v1::StoreRequest::CHECK, keys);
  if (!r.ok()) return r.status();
  return r->flag();
}

absl::Status GrpcStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  return impl_->call(v1::StoreRequest::WAIT, keys, {}, 0, timeout).status();
}

absl::StatusOr<std::int64_t> GrpcStore::num_keys() {
  auto r = impl_->call(v1::StoreRequest::NUM_KEYS, {});
  if (!r.ok()) return r.status();
  return r->number();
}

absl::StatusOr<std::vector<std::string>> GrpcStore::multi_get(const std::vector<std::string>& keys,
                                                              Duration timeout) {
  auto r = impl_->call(v1::StoreRequest::MULTI_GET, keys, {}, 0, timeout);
  if (!r.ok()) return r.status();
  return std::vector<std::string>(r->values().begin(), r->values().end());
}

absl::Status GrpcStore::multi_set(const std::vector<std::string>& keys,
                                  const std::vector<std::string>& values) {
  return impl_->call(v1::StoreRequest::MULTI_SET, keys, values).status();
}

}  // namespace muster::rendezvous
