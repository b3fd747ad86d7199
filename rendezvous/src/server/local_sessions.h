// The sessions of agents in this process (private to server*.cc): launch --standalone's
// embedded server and its agent share one io_context, and the agent's session needs no
// socket (muster/rendezvous/local_session.h). To the core each is what a gRPC stream is: opened,
// its messages checked at the same edge (size, token) and handed over in order, its end seen
// as a closed stream.
#pragma once

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "muster/rendezvous/local_session.h"
#include "server/server_core.h"

namespace muster::rendezvous::server_internal {

class LocalSessions final : public LocalServer {
 public:
  explicit LocalSessions(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  // io thread.
  std::unique_ptr<LocalStream> open(Handlers handlers) override;

  // Any thread, at the server's shutdown: every open session ends (UNAVAILABLE) on the io
  // thread, as the server's Shutdown cancels its streams; a later open() ends at once.
  void shutdown();

  class Session;

 private:
  std::shared_ptr<Core> core_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::weak_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muster::rendezvous::server_internal
