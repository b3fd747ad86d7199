// The Join every state-machine test sends: run "run", host "host-<node>", any rank.
#pragma once

#include <string>

#include "muster/v1/rendezvous.pb.h"

namespace muster::testing {

inline v1::AgentMsg join_msg(const std::string& node, int min, int max, int max_restarts = 0,
                             int nproc = 2, int requested = -1) {
  v1::AgentMsg m;
  v1::Join* j = m.mutable_join();
  j->set_run_id("run");
  j->set_node_id(node);
  j->set_host("host-" + node);
  j->set_local_world_size(nproc);
  j->set_min_nodes(min);
  j->set_max_nodes(max);
  j->set_max_restarts(max_restarts);
  j->set_requested_rank(requested);
  return m;
}

}  // namespace muster::testing
