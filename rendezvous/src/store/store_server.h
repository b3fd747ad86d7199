// The Store service (private to the rendezvous server). Clients keep long-lived streams open
// (a unary call per operation would cost a new HTTP/2 stream each time) and send one request
// at a time on each. Every request is served on the gRPC thread that read it by a StoreCore
// (store_core.h: per-run locks, waits indexed by the keys they miss); a wait parks until a
// write completes it, its deadline passes (one timer thread sleeps until the earliest), its
// client goes (OnCancel), its run is dropped or the server shuts down. Nothing polls.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "muster/rendezvous/credentials.h"
#include "muster/rendezvous/store.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {

class StoreServer {
 public:
  // Every request's token must open its run (`credentials`; null: an open server).
  // With `require_open_runs` (the default), a request for a run that open_run() has not
  // named (or that drop() has ended) is refused with FAILED_PRECONDITION "store: unknown run
  // 'X'", so a client cannot create tables for runs the rendezvous never knew. false: the
  // first request for a run creates its table.
  StoreServer(StoreLimits limits, std::shared_ptr<const Credentials> credentials,
              bool require_open_runs = true);
  ~StoreServer();

  // Before BuildAndStart. The server must be shut down before this object goes.
  void register_with(grpc::ServerBuilder& builder);
  // Opens the run's table (the rendezvous calls it when it creates a run). Idempotent. Any
  // thread.
  void open_run(const std::string& run_id);
  // Drops a finished run's table, answers its parked waits (FAILED_PRECONDITION), and returns
  // the memory to the OS when the table was large. Any thread.
  void drop(const std::string& run_id);
  // Answers every parked wait at once with UNAVAILABLE "store: the server is shutting down",
  // ends those streams, and refuses every later request the same way, so that
  // grpc::Server::Shutdown() need not wait for the longest wait's timeout. Call before
  // grpc::Server::Shutdown(). Idempotent. Any thread but a gRPC callback's.
  void shutdown();
  // Waits parked now (for tests and metrics).
  std::size_t parked_waits() const;
  // Requests handled since start, by v1::StoreRequest::Op (unknown ops as OP_UNSPECIFIED).
  static constexpr int kNumOps = v1::StoreRequest::Op_ARRAYSIZE;
  std::array<std::uint64_t, kNumOps> op_counts() const;


  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
