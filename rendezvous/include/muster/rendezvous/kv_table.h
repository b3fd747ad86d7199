// One run's key-value table: the store's data and rules without any waiting (the callers
// wait: MemoryStore on a condition variable, the server's StoreCore on its waiter index).
// Every limit of StoreLimits that concerns the table is enforced here, so both get the same
// rules; a refused call changes nothing.
// Thread safety: none; the owner serialises access.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muster/rendezvous/store.h"

namespace muster::rendezvous {

class KvTable {
 public:
  // The i-th key (or value) of a request, so that callers need not copy a proto's repeated
  // field into a vector.
  using At = absl::FunctionRef<const std::string&(std::size_t)>;

  explicit KvTable(StoreLimits limits = {}) : limits_(limits) {}

  absl::Status set(const std::string& key, const std::string& value);
  const std::string* find(const std::string& key) const;
  // OUT_OF_RANGE (naming the key, nothing written) when the sum leaves int64.
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta);
  absl::StatusOr<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired);
  bool erase(const std::string& key);
  bool contains_all(const std::vector<std::string>& keys) const;
  bool contains_all(std::size_t n, At key) const;
  // Sets all or nothing: the whole batch (its distinct new keys and its new byte total) is
  // checked against the limits before anything is written. A key named twice takes the last
  // value.
  absl::Status multi_set(std::size_t n, At key, At value);
  absl::Status multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values);
  // The values of `keys` (all present) in order, or RESOURCE_EXHAUSTED when together they
  // exceed max_message_bytes (one reply must carry them).
  absl::Status check_reply(std::size_t n, At key) const;

  std::size_t size() const { return map_.size(); }
  // Bytes of keys plus values held.
  std::size_t bytes() const { return bytes_; }
  const StoreLimits& limits() const { return limits_; }

  // Checks a key (and optional value) against the limits without storing anything.
  absl::Status check_key(const std::string& key) const;
  absl::Status check_entry(const std::string& key, const std::string& value) const;
  // Checks the keys of one request: their number (max_keys_per_request) and each one's size.
  absl::Status check_keys(std::size_t n, At key) const;
  absl::Status check_keys(const std::vector<std::string>& keys) const;

 private:
  void put(const std::string& key, const std::string& value);  // no checks
  absl::Status check_growth(std::size_t new_keys, std::size_t bytes_after) const;

  StoreLimits limits_;
  std::unordered_map<std::string, std::string> map_;
  std::size_t bytes_ = 0;
};

}  // namespace muster::rendezvous
