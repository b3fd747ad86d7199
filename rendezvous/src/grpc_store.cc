#include "muster/rendezvous/grpc_store.h"

#include <grpcpp/grpcpp.h>

#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {

using Op = v1::StoreRequest::Op;

class GrpcStore::Impl {
 public:
  explicit Impl(GrpcStoreOptions o) : opts(std::move(o)) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(16 << 20);
    stub = v1::Store::NewStub(
        grpc::CreateCustomChannel(opts.target, grpc::InsecureChannelCredentials(), args));
  }

  // One RPC. `wait` is how long the server may hold it (0 for calls that do not wait).
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
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + wait + opts.call_timeout);
    v1::StoreReply reply;
    grpc::Status st = stub->Call(&ctx, req, &reply);
    if (!st.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
    }
    return reply;
  }

  GrpcStoreOptions opts;
  std::unique_ptr<v1::Store::Stub> stub;
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
