#include "muster/agent/endpoints.h"

#include <algorithm>

#include "muster/rendezvous/limits.h"

namespace muster::agent {

Endpoints::Endpoints(std::vector<RdzvEndpoint> list) : list_(std::move(list)) {
  if (list_.empty()) list_.emplace_back();
}

std::chrono::milliseconds Endpoints::attempt(std::chrono::milliseconds left,
                                             std::chrono::milliseconds window) const {
  left = std::max(left, std::chrono::milliseconds(1));
  if (list_.size() == 1) return left;
  return std::min(left, std::max(window, rendezvous::limits::kMinConnectAttempt));
}

std::string Endpoints::names() const {
  std::string out;
  for (const RdzvEndpoint& e : list_) {
    if (!out.empty()) out += ", ";
    out += e.name.empty() ? e.target : e.name;
  }
  return out;
}

}  // namespace muster::agent
