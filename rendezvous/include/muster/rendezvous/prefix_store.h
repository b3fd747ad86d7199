// A Store decorator that puts `prefix` in front of every key (c10d's PrefixStore): one table
// shared by rounds or components without collisions. Does not own `base`.
#pragma once

#include "muster/rendezvous/store.h"

namespace muster::rendezvous {

class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, Store& base) : prefix_(std::move(prefix)), base_(base) {}

  absl::Status set(const std::string& key, const std::string& value) override {
    return base_.set(k(key), value);
  }
  absl::StatusOr<std::string> get(const std::string& key, Duration timeout) override {
    return base_.get(k(key), timeout);
  }
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    return base_.add(k(key), delta);
  }
  absl::StatusOr<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired) override {
    return base_.compare_set(k(key), expected, desired);
  }
  absl::StatusOr<bool> delete_key(const std::string& key) override {
    return base_.delete_key(k(key));
  }
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override {
    return base_.check(ks(keys));
  }
  absl::Status wait(const std::vector<std::string>& keys, Duration timeout) override {
    return base_.wait(ks(keys), timeout);
  }
  // The whole base table's count, as c10d's PrefixStore.
  absl::StatusOr<std::int64_t> num_keys() override { return base_.num_keys(); }
  absl::StatusOr<std::vector<std::string>> multi_get(const std::vector<std::string>& keys,
                                                     Duration timeout) override {
    return base_.multi_get(ks(keys), timeout);
  }
  absl::Status multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) override {
    return base_.multi_set(ks(keys), values);
  }

 private:
  std::string k(const std::string& key) const { return prefix_ + key; }
  std::vector<std::string> ks(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& key : keys) out.push_back(k(key));
    return out;
  }

  std::string prefix_;
  Store& base_;
};

}  // namespace muster::rendezvous
