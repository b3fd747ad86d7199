// One run's key-value table: the store's data and rules without any waiting (the callers
// wait: MemoryStore on a condition variable, the server on its event loop).
// Thread safety: none; the owner serialises access.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muster/rendezvous/store.h"

namespace muster::rendezvous {

class KvTable {
 public:
  explicit KvTable(StoreLimits limits = {}) : limits_(limits) {}

  absl::Status set(const std::string& key, const std::string& value);
  const std::string* find(const std::string& key) const;
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta);
  absl::StatusOr<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired);
  bool erase(const std::string& key);
  bool contains_all(const std::vector<std::string>& keys) const;
  std::size_t size() const { return map_.size(); }

  // Checks a key (and optional value) against the limits without storing anything.
  absl::Status check_key(const std::string& key) const;
  absl::Status check_entry(const std::string& key, const std::string& value) const;

 private:
  StoreLimits limits_;
  std::unordered_map<std::string, std::string> map_;
};

}  // namespace muster::rendezvous
