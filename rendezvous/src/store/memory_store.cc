#include "muster/rendezvous/memory_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace muster::rendezvous {

absl::Status MemoryStore::set(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  return table_.set(key, value);
}

absl::Status MemoryStore::wait_locked(const std::vector<std::string>& keys, Duration timeout) {
  if (absl::Status s = table_.check_keys(keys); !s.ok()) return s;
  auto present = [this, &keys]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return table_.contains_all(keys);
  };
  // A negative timeout is 0; a huge one waits at most max_wait (no overflow).
  const Duration wait = std::clamp(timeout, Duration(0), table_.limits().max_wait);
  if (present()) return absl::OkStatus();
  waiting_.fetch_add(1, std::memory_order_relaxed);
  const bool woken = mu_.AwaitWithTimeout(absl::Condition(&present), absl::FromChrono(wait));
  waiting_.fetch_sub(1, std::memory_order_relaxed);
  if (!woken) {
    return absl::DeadlineExceededError(absl::StrCat("store: timed out after ", wait.count(),
                                                    " ms waiting for ", keys.size(), " key(s)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryStore::get(const std::string& key, Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = wait_locked({key}, timeout); !s.ok()) return s;
  return *table_.find(key);
}

absl::StatusOr<std::int64_t> MemoryStore::add(const std::string& key, std::int64_t delta) {
  absl::MutexLock lock(&mu_);
  return table_.add(key, delta);
}

absl::StatusOr<std::string> MemoryStore::compare_set(const std::string& key,
                                                     const std::string& expected,
                                                     const std::string& desired) {
  absl::MutexLock lock(&mu_);
  return table_.compare_set(key, expected, desired);
}

absl::StatusOr<bool> MemoryStore::delete_key(const std::string& key) {
  absl::MutexLock lock(&mu_);
  return table_.erase(key);
}

absl::StatusOr<bool> MemoryStore::check(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = table_.check_keys(keys); !s.ok()) return s;
  return table_.contains_all(keys);
}

absl::Status MemoryStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  absl::MutexLock lock(&mu_);
  return wait_locked(keys, timeout);
}

absl::StatusOr<std::int64_t> MemoryStore::num_keys() {
  absl::MutexLock lock(&mu_);
  return static_cast<std::int64_t>(table_.size());
}

absl::StatusOr<std::vector<std::string>> MemoryStore::multi_get(
    const std::vector<std::string>& keys, Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = wait_locked(keys, timeout); !s.ok()) return s;
  if (absl::Status s = table_.check_reply(
          keys.size(), [&](std::size_t i) -> const std::string& { return keys[i]; });
      !s.ok()) {
    return s;
  }
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(*table_.find(k));
  return out;
}

absl::Status MemoryStore::multi_set(const std::vector<std::string>& keys,
                                    const std::vector<std::string>& values) {
  absl::MutexLock lock(&mu_);
  return table_.multi_set(keys, values);
}

}  // namespace muster::rendezvous
