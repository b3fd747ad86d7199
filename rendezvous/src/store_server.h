// The Store service, on gRPC's async (completion queue) API: one thread drives the queue's
// I/O and serves every request itself, so a request costs no thread hand-off. Clients keep
// streams open (a unary call per operation costs a new HTTP/2 stream each time). Waits (get, wait,
// multi_get on missing keys) park until a write completes them or their grpc::Alarm, on the
// same queue, times them out. Private to the rendezvous server.
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

  // Before BuildAndStart.
  void register_with(grpc::ServerBuilder& builder);
  // After BuildAndStart: starts the queue's thread.
  void start();
  // Drops a finished run's table. Any thread.
  void drop(const std::string& run_id);
  // After the grpc::Server has been shut down: drains the queue and joins the thread.
  void shutdown();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
