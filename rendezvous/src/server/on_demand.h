// Listeners that start gRPC with their first connection (private to server*.cc;
// ServerOptions::start_grpc_on_demand). It binds a TCP port and, optionally, an abstract
// Unix-domain socket itself; a thread of its own accepts, builds the gRPC server (once, with
// no port of its own) when the first connection arrives, and hands it every connection
// (grpc::AddInsecureChannelFromFd). Plaintext only.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace muster::rendezvous::server_internal {

class OnDemandListener {
 public:
  using Build = std::function<std::unique_ptr<grpc::Server>()>;

  // Binds `ipv4_address` (A.B.C.D:PORT, port 0 picks one) and, when `abstract_name` is not
  // empty, the abstract socket of that name; then accepts on its thread. `build` runs there.
  static absl::StatusOr<std::unique_ptr<OnDemandListener>> open(const std::string& ipv4_address,
                                                                const std::string& abstract_name,
                                                                Build build);
  ~OnDemandListener();  // stop()
  OnDemandListener(const OnDemandListener&) = delete;
  OnDemandListener& operator=(const OnDemandListener&) = delete;

  int port() const { return port_; }
  // Any thread: stops accepting and closes the listeners (a connection not yet accepted is
  // refused), then joins the thread. Safe to call twice.
  void stop();
  // After stop(): the gRPC server built, or null when no connection ever came.
  grpc::Server* server() const { return server_.get(); }

 private:
  OnDemandListener() = default;
  void run();
  void serve(int fd);

  int tcp_fd_ = -1;
  int unix_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd: stop() writes it
  int port_ = 0;
  Build build_;
  std::unique_ptr<grpc::Server> server_;  // the thread's until stop() has joined it
  bool build_failed_ = false;
  std::thread thread_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace muster::rendezvous::server_internal
