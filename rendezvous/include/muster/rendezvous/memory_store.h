// An in-process Store: a KvTable under a mutex; waiters sleep on a condition variable that
// every write notifies.
#pragma once

#include <condition_variable>
#include <mutex>

#include "muster/rendezvous/kv_table.h"
#include "muster/rendezvous/store.h"

namespace muster::rendezvous {

class MemoryStore final : public Store {
 public:
  explicit MemoryStore(StoreLimits limits = {}) : table_(limits) {}

  absl::Status set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> get(const std::string& key, Duration timeout) override;
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) override;
  absl::StatusOr<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired) override;
  absl::StatusOr<bool> delete_key(const std::string& key) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::Status wait(const std::vector<std::string>& keys, Duration timeout) override;
  absl::StatusOr<std::int64_t> num_keys() override;
  absl::StatusOr<std::vector<std::string>> multi_get(const std::vector<std::string>& keys,
                                                     Duration timeout) override;
  absl::Status multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) override;

 private:
  // REQUIRES: lock holds mu_.
  absl::Status wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                           Duration timeout);

  std::mutex mu_;
  std::condition_variable changed_;
  KvTable table_;  // guarded by mu_
};

}  // namespace muster::rendezvous
