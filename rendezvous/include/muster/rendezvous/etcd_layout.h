// How rdzvd --etcd keeps a RunRecord in etcd (docs/rendezvous.md, "Replicated rdzvd on etcd").
// Pure: keys and values only, no client.
//
// Per-node keys, not one blob per run, so a round of 10,000 nodes stays within etcd's value
// and request limits:
//   PREFIX runs/<hex run id>/h                  EtcdRunHead: the record without its nodes
//   PREFIX runs/<hex run id>/g<16 hex>/<8 dec>  EtcdRunNode i of that generation
// A write of new node keys goes to a fresh generation (as many transactions as it takes); the
// head, written last, names the generation, so a reader finds a whole old record or a whole
// new one, never a mix. The same transaction as the head deletes every other generation.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous::etcd_layout {

std::string runs_prefix(const std::string& prefix);                      // PREFIX runs/
std::string run_prefix(const std::string& prefix, const std::string& run_id);  // .../<hex>/
std::string head_key(const std::string& prefix, const std::string& run_id);
std::string generation_prefix(const std::string& prefix, const std::string& run_id,
                              std::int64_t generation);
std::string node_key(const std::string& prefix, const std::string& run_id,
                     std::int64_t generation, int index);
// The smallest key after every key that starts with `p` (etcd's range_end for a prefix).
std::string prefix_end(const std::string& p);

struct Split {
  v1::EtcdRunHead head;            // generation left for the writer to set
  std::vector<std::string> nodes;  // serialized EtcdRunNode, by index
};
Split split(const v1::RunRecord& record);

// Every key under runs_prefix(prefix) as read back, to records: a run whose head does not
// parse, or whose generation lacks a node key, is skipped with one line saying why. Keys
// of other generations (a write that never finished) are ignored.
struct Joined {
  std::vector<v1::RunRecord> records;
  std::vector<std::int64_t> generations;  // records[i]'s
  std::vector<std::string> skipped;
  std::int64_t max_generation = 0;  // of any node key, whole or not
};
Joined join(const std::string& prefix, const std::map<std::string, std::string>& kvs);

}  // namespace muster::rendezvous::etcd_layout
