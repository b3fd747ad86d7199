#include "muster/rendezvous/kv_table.h"

#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace muster::rendezvous {

namespace {
absl::string_view shown(const std::string& key) { return absl::string_view(key).substr(0, 64); }
}  // namespace

absl::Status KvTable::check_key(const std::string& key) const {
  if (key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: key of ", key.size(),
                                                   " bytes is over the limit of ",
                                                   limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::Status KvTable::check_keys(std::size_t n, At key) const {
  if (n > limits_.max_keys_per_request) {
    return absl::ResourceExhaustedError(absl::StrCat("store: a request of ", n,
                                                     " keys is over the limit of ",
                                                     limits_.max_keys_per_request));
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (absl::Status s = check_key(key(i)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status KvTable::check_keys(const std::vector<std::string>& keys) const {
  return check_keys(keys.size(), [&](std::size_t i) -> const std::string& { return keys[i]; });
}

absl::Status KvTable::check_growth(std::size_t new_keys, std::size_t bytes_after) const {
  if (new_keys > 0 && map_.size() + new_keys > limits_.max_keys) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store: the table holds ", map_.size(), " keys; ", new_keys,
        " more would be over the limit of ", limits_.max_keys, " keys"));
  }
  if (bytes_after > bytes_ && bytes_after > limits_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store: the table would hold ", bytes_after, " bytes of keys and values, over the limit of ",
        limits_.max_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status KvTable::check_entry(const std::string& key, const std::string& value) const {
  if (absl::Status s = check_key(key); !s.ok()) return s;
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: value of ", value.size(),
                                                   " bytes for key '", shown(key),
                                                   "' is over the limit of ",
                                                   limits_.max_value_bytes));
  }
  auto it = map_.find(key);
  if (it == map_.end()) return check_growth(1, bytes_ + key.size() + value.size());
  return check_growth(0, bytes_ - it->second.size() + value.size());
}

absl::Status KvTable::set(const std::string& key, const std::string& value) {
  if (absl::Status s = check_entry(key, value); !s.ok()) return s;
  put(key, value);
  return absl::OkStatus();
}

void KvTable::put(const std::string& key, const std::string& value) {
  auto [it, fresh] = map_.try_emplace(key);
  if (fresh) {
    bytes_ += key.size();
  } else {
    bytes_ -= it->second.size();
  }
  bytes_ += value.size();
  it->second = value;
}

absl::Status KvTable::multi_set(std::size_t n, At key, At value) {
  if (absl::Status s = check_keys(n, key); !s.ok()) return s;
  // The last value of each distinct key, as the writes below will leave it.
  std::unordered_map<std::string_view, std::size_t> last;
  last.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& v = value(i);
    if (v.size() > limits_.max_value_bytes) return check_entry(key(i), v);
    last[key(i)] = i;
  }
  std::size_t new_keys = 0;
  std::size_t bytes_after = bytes_;
  for (const auto& [k, i] : last) {
    auto it = map_.find(std::string(k));
    if (it == map_.end()) {
      ++new_keys;
      bytes_after += k.size() + value(i).size();
    } else {
      bytes_after = bytes_after - it->second.size() + value(i).size();
    }
  }
  if (absl::Status s = check_growth(new_keys, bytes_after); !s.ok()) return s;
  // Checked as a whole above; one by one, an intermediate state could exceed a bound the end
  // state keeps (a new key written before a value that shrinks), so write unchecked.
  for (const auto& [k, i] : last) put(key(i), value(i));
  return absl::OkStatus();
}

absl::Status KvTable::multi_set(const std::vector<std::string>& keys,
                                const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError("store: multi_set with different numbers of keys and values");
  }
  return multi_set(
      keys.size(), [&](std::size_t i) -> const std::string& { return keys[i]; },
      [&](std::size_t i) -> const std::string& { return values[i]; });
}

absl::Status KvTable::check_reply(std::size_t n, At key) const {
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (const std::string* v = find(key(i)); v != nullptr) total += v->size();
  }
  if (total > limits_.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store: the values of ", n, " keys come to ", total,
        " bytes, over the limit of one reply (", limits_.max_message_bytes, " bytes)"));
  }
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
        absl::StrCat("store: add on key '", shown(key), "' whose value is not an integer"));
  }
  std::int64_t sum = 0;
  if (__builtin_add_overflow(current, delta, &sum)) {
    return absl::OutOfRangeError(absl::StrCat("store: add of ", delta, " to key '", shown(key),
                                              "' (", current, ") would leave int64"));
  }
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

bool KvTable::erase(const std::string& key) {
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  bytes_ -= it->first.size() + it->second.size();
  map_.erase(it);
  return true;
}

bool KvTable::contains_all(const std::vector<std::string>& keys) const {
  return contains_all(keys.size(), [&](std::size_t i) -> const std::string& { return keys[i]; });
}

bool KvTable::contains_all(std::size_t n, At key) const {
  for (std::size_t i = 0; i < n; ++i) {
    if (map_.count(key(i)) == 0) return false;
  }
  return true;
}

}  // namespace muster::rendezvous
