// One grpc.health.v1 Check for the integration tests: the status a server reports for
// `service`, UNKNOWN when the call failed (its code in *code).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"

namespace muster::testing {

inline grpc::health::v1::HealthCheckResponse::ServingStatus check(
    grpc::health::v1::Health::Stub& stub, const std::string& service,
    grpc::StatusCode* code = nullptr) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status st = stub.Check(&ctx, req, &resp);
  if (code != nullptr) *code = st.error_code();
  return st.ok() ? resp.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
}

}  // namespace muster::testing
