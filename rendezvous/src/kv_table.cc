#include "muster/rendezvous/kv_table.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace muster::rendezvous {

absl::Status KvTable::check_key(const std::string& key) const {
  if (key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: key of ", key.size(),
                                                   " bytes is over the limit of ",
                                                   limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::Status KvTable::check_entry(const std::string& key, const std::string& value) const {
  if (absl::Status s = check_key(key); !s.ok()) return s;
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: value of ", value.size(),
                                                   " bytes for key '", key.substr(0, 64),
                                                   "' is over the limit of ",
                                                   limits_.max_value_bytes));
  }
  if (map_.size() >= limits_.max_keys && map_.count(key) == 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("store: the table already holds the limit of ", limits_.max_keys, " keys"));
  }
  return absl::OkStatus();
}

absl::Status KvTable::set(const std::string& key, const std::string& value) {
  if (absl::Status s = check_entry(key, value); !s.ok()) return s;
  map_[key] = value;
  return absl::OkStatus();
}

const std::string* KvTable::find(const std::string& key) const {
  auto it = map_.find(key);
  return it == map_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::int64_t> KvTable::add(const std::string& key, std::int64_t delta) {
  std::int64_t current = 0;
  if (const std::string* v = find(key); v != nullptr && !absl::SimpleAtoi(*v, &current)) {
    return absl::InvalidArgumentError(
        absl::StrCat("store: add on key '", key.substr(0, 64), "' whose value is not an integer"));
  }
  const std::int64_t sum = current + delta;
  if (absl::Status s = set(key, std::to_string(sum)); !s.ok()) return s;
  return sum;
}

absl::StatusOr<std::string> KvTable::compare_set(const std::string& key,
                                                 const std::string& expected,
                                                 const std::string& desired) {
  const std::string* v = find(key);
  if (v == nullptr) {
    if (!expected.empty()) return expected;
  } else if (*v != expected) {
    return *v;
  }
  if (absl::Status s = set(key, desired); !s.ok()) return s;
  return desired;
}

bool KvTable::erase(const std::string& key) { return map_.erase(key) > 0; }

bool KvTable::contains_all(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (map_.count(k) == 0) return false;
  }
  return true;
}

}  // namespace muster::rendezvous
