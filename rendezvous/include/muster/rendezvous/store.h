// The Store: c10d's key-value store semantics, behind one interface.
//
// Implementations: MemoryStore (in-process), GrpcStore (a client of the rendezvous server's
// Store service) and PrefixStore (a decorator that namespaces keys). One conformance suite
// (tests/unit/store_test.cc) runs against each.
//
// Semantics (as PyTorch's c10d Store):
// - set(k, v) creates or replaces k.
// - get(k, timeout) blocks until k exists, then returns its value. When `timeout` passes first
//   it returns DEADLINE_EXCEEDED; it never returns an empty value in place of a timeout.
// - add(k, delta) treats k as a decimal integer (a missing key counts as 0), stores the sum and
//   returns it. A value that is not an integer is INVALID_ARGUMENT.
// - compare_set(k, expected, desired): if k exists and equals `expected`, sets it to `desired`
//   and returns `desired`; if k exists with another value, returns that value unchanged. If k is
//   missing: with an empty `expected` it is created with `desired`, which is returned; otherwise
//   nothing changes and `expected` is returned (c10d's rule).
// - delete_key(k) returns whether k existed.
// - check(keys) returns whether all exist, without waiting.
// - wait(keys, timeout) blocks until all exist; DEADLINE_EXCEEDED when `timeout` passes first.
// - num_keys() counts the keys of the whole table (for PrefixStore too, as in c10d).
// - multi_get(keys, timeout) waits like wait() and returns the values in order;
//   multi_set(keys, values) sets each (sizes must match).
// Waiting never busy-polls: waiters are woken by the writes that complete them.
// Limits (StoreLimits, defaults in limits.h), each refused with a message naming the limit,
// and nothing changed by the refused request:
// - a key longer than max_key_bytes or a value longer than max_value_bytes: INVALID_ARGUMENT;
// - a write that would make the table hold more than max_keys keys, or more than max_bytes
//   bytes of keys plus values: RESOURCE_EXHAUSTED. A multi_set is checked as a whole (its
//   distinct new keys and its new byte total) before any of it is written;
// - a request naming more than max_keys_per_request keys: RESOURCE_EXHAUSTED;
// - a multi_get whose values would exceed max_message_bytes in one reply: RESOURCE_EXHAUSTED.
// Timeouts: a wait longer than max_wait is clamped to it (so a huge timeout waits, it does not
// overflow into an immediate DEADLINE_EXCEEDED); a negative timeout counts as 0.
// add: a sum outside int64 is OUT_OF_RANGE naming the key; the key keeps its value.
// (GrpcStore writes sets behind: it reports a refused set from its next call; see
// grpc_store.h.) The server's Store service also refuses requests for runs the rendezvous
// does not know (FAILED_PRECONDITION) and run ids that are not UTF-8 (INVALID_ARGUMENT).
//
// Thread safety: every implementation may be called from several threads at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muster/rendezvous/limits.h"

namespace muster::rendezvous {

struct StoreLimits {
  std::size_t max_key_bytes = limits::kMaxStoreKeyBytes;
  std::size_t max_value_bytes = limits::kMaxStoreValueBytes;
  std::size_t max_keys = limits::kMaxStoreKeysPerRun;
  std::size_t max_bytes = limits::kMaxStoreBytesPerRun;
  std::size_t max_keys_per_request = limits::kMaxStoreKeysPerRequest;
  std::size_t max_message_bytes = limits::kMaxStoreMessageBytes;
  std::chrono::milliseconds max_wait = limits::kMaxStoreWait;
};

class Store {
 public:
  using Duration = std::chrono::milliseconds;
  virtual ~Store() = default;

  virtual absl::Status set(const std::string& key, const std::string& value) = 0;
  virtual absl::StatusOr<std::string> get(const std::string& key, Duration timeout) = 0;
  virtual absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) = 0;
  virtual absl::StatusOr<std::string> compare_set(const std::string& key,
                                                  const std::string& expected,
                                                  const std::string& desired) = 0;
  virtual absl::StatusOr<bool> delete_key(const std::string& key) = 0;
  virtual absl::StatusOr<bool> check(const std::vector<std::string>& keys) = 0;
  virtual absl::Status wait(const std::vector<std::string>& keys, Duration timeout) = 0;
  virtual absl::StatusOr<std::int64_t> num_keys() = 0;
  virtual absl::StatusOr<std::vector<std::string>> multi_get(const std::vector<std::string>& keys,
                                                             Duration timeout) = 0;
  virtual absl::Status multi_set(const std::vector<std::string>& keys,
                                 const std::vector<std::string>& values) = 0;
};

}  // namespace muster::rendezvous
