// The rendezvous endpoints an agent may use (--rdzv_endpoint=a:29400,b:29400) and which one
// it tries next. The agent stays on the endpoint that answers; when a connection attempt
// fails it moves to the next one, round the list (docs/rendezvous.md, "Restarting the server
// without restarting workers"). Pure: no sockets, no clock.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace muster::agent {

struct RdzvEndpoint {
  std::string target;  // the gRPC target (an address: ipv4:A:P, ...)
  std::string name;    // as messages name it (the endpoint as given)
};

class Endpoints {
 public:
  // At least one endpoint (an empty list holds one empty endpoint).
  explicit Endpoints(std::vector<RdzvEndpoint> list);

  const RdzvEndpoint& current() const { return list_[at_]; }
  // The k-th after current(), round the list (current() itself for k = 0 or size()).
  const RdzvEndpoint& after(std::size_t k) const { return list_[(at_ + k) % list_.size()]; }
  std::size_t index() const { return at_; }
  std::size_t size() const { return list_.size(); }
  // After a failed attempt on current(): the next one, round the list.
  void next() { at_ = (at_ + 1) % list_.size(); }

  // How long one connection attempt may wait for current() when `left` remains in all: with
  // one endpoint, all of it; with several, one liveness window (at least
  // limits::kMinConnectAttempt, at most `left`), so that a dead one does not keep the others
  // from their turn.
  std::chrono::milliseconds attempt(std::chrono::milliseconds left,
                                    std::chrono::milliseconds window) const;

  // "a:1" or "a:1, b:2" (every name, for messages about all of them).
  std::string names() const;

 private:
  std::vector<RdzvEndpoint> list_;
  std::size_t at_ = 0;
};

}  // namespace muster::agent
