#include "muster/rendezvous/etcd_layout.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/state_machine.h"
#include "muster/ops/text.h"

namespace muster::rendezvous::etcd_layout {

std::string runs_prefix(const std::string& prefix) { return absl::StrCat(prefix, "runs/"); }

std::string run_prefix(const std::string& prefix, const std::string& run_id) {
  return absl::StrCat(runs_prefix(prefix), absl::BytesToHexString(run_id), "/");
}

std::string head_key(const std::string& prefix, const std::string& run_id) {
  return absl::StrCat(run_prefix(prefix, run_id), "h");
}

std::string generation_prefix(const std::string& prefix, const std::string& run_id,
                              std::int64_t generation) {
  return absl::StrCat(run_prefix(prefix, run_id), absl::StrFormat("g%016x/", generation));
}

std::string node_key(const std::string& prefix, const std::string& run_id,
                     std::int64_t generation, int index) {
  return absl::StrCat(generation_prefix(prefix, run_id, generation),
                      absl::StrFormat("%08d", index));
}

std::string prefix_end(const std::string& p) {
  std::string end = p;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // etcd: every key from the start
}

Split split(const v1::RunRecord& record) {
  Split s;
  *s.head.mutable_record() = record;
  s.head.mutable_record()->clear_members();
  s.head.mutable_record()->clear_last_rank();
  s.head.set_members(record.members_size());
  s.head.set_last_ranks(record.last_rank_size());
  const int n = std::max(record.members_size(), record.last_rank_size());
  s.nodes.reserve(n);
  for (int i = 0; i < n; ++i) {
    v1::EtcdRunNode node;
    if (i < record.members_size()) *node.mutable_member() = record.members(i);
    if (i < record.last_rank_size()) *node.mutable_last_rank() = record.last_rank(i);
    s.nodes.push_back(node.SerializeAsString());
  }
  return s;
}

Joined join(const std::string& prefix, const std::map<std::string, std::string>& kvs) {
  Joined out;
  const std::string runs = runs_prefix(prefix);
  for (auto it = kvs.lower_bound(runs); it != kvs.end() && it->first.starts_with(runs); ++it) {
    const std::string& key = it->first;
    if (auto g = key.find("/g", runs.size()); g != std::string::npos) {
      std::int64_t gen = 0;
      if (absl::SimpleHexAtoi(key.substr(g + 2, 16), &gen)) {
        out.max_generation = std::max(out.max_generation, gen);
      }
      continue;
    }
    if (!key.ends_with("/h")) continue;
    const std::string hex = key.substr(runs.size(), key.size() - runs.size() - 2);
    const std::string run_id = absl::HexStringToBytes(hex);
    auto skip = [&](auto&&... why) {
      out.skipped.push_back(absl::StrCat("run '", ops::printable_utf8(run_id, limits::kMaxIdBytes),
                                         "' in etcd (", key, "): ", why...));
    };
    if (hex.empty() || hex.find('/') != std::string::npos ||
        absl::BytesToHexString(run_id) != hex) {
      out.skipped.push_back(absl::StrCat("a key that is not a run's head: ", key));
      continue;
    }
    v1::EtcdRunHead head;
    if (!head.ParseFromString(it->second) || head.record().run_id() != run_id ||
        head.members() < 0 || head.last_ranks() < 0 || head.members() > kMaxNodes ||
        head.last_ranks() > kMaxNodes) {
      skip("the head does not parse or does not match its key");
      continue;
    }
    v1::RunRecord record = head.record();
    const int n = std::max(head.members(), head.last_ranks());
    bool whole = true;
    for (int i = 0; i < n && whole; ++i) {
      auto node = kvs.find(node_key(prefix, run_id, head.generation(), i));
      v1::EtcdRunNode entry;
      if (node == kvs.end() || !entry.ParseFromString(node->second) ||
          (i < head.members()) != entry.has_member() ||
          (i < head.last_ranks()) != entry.has_last_rank()) {
        skip("node key ", i, " of generation ", head.generation(), " is missing or damaged");
        whole = false;
        break;
      }
      if (entry.has_member()) *record.add_members() = std::move(*entry.mutable_member());
      if (entry.has_last_rank()) *record.add_last_rank() = std::move(*entry.mutable_last_rank());
    }
    if (!whole) continue;
    out.records.push_back(std::move(record));
    out.generations.push_back(head.generation());
  }
  return out;
}

}  // namespace muster::rendezvous::etcd_layout
