// An in-process Store: a KvTable under an absl::Mutex; a waiter sleeps in
// Mutex::AwaitWithTimeout, which re-checks its condition whenever a writer releases the lock.
#pragma once

#include <atomic>
#include <cstddef>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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

  // Calls parked now, waiting for keys (for tests and metrics, as StoreServer::parked_waits).
  std::size_t waiting() const { return waiting_.load(std::memory_order_relaxed); }

 private:
  absl::Status wait_locked(const std::vector<std::string>& keys, Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  KvTable table_ ABSL_GUARDED_BY(mu_);
  std::atomic<std::size_t> waiting_{0};  // changed under mu_, read without it
};

}  // namespace muster::rendezvous
