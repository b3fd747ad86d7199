// The Store service (private to the rendezvous server). Clients keep long-lived streams open
// (a unary call per operation would cost a new HTTP/2 stream each time) and send one request
// at a time on each. Every request is served on the gRPC thread that read it, under one mutex
// over the tables (no hand-off to another thread); a wait parks until a write completes it or
// its grpc::Alarm times it out. Nothing polls.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "muster/rendezvous/store.h"

namespace muster::rendezvous {

class StoreServer {
 public:
  StoreServer(StoreLimits limits, std::string token);
  ~StoreServer();

  // Before BuildAndStart. The server must be shut down before this object goes.
  void register_with(grpc::ServerBuilder& builder);
  // Drops a finished run's table. Any thread.
  void drop(const std::string& run_id);

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
