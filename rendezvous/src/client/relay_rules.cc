#include "client/relay_rules.h"

namespace muster::rendezvous::relay {

using tcpstore::Op;
using tcpstore::Request;

void WorldCache::remember(const Request& req, bool caching) {
  switch (req.op) {
    case Op::kSet:
    case Op::kMultiSet:
      for (std::size_t i = 0; i < req.keys.size() && i < req.values.size(); ++i) {
        keep(req.keys[i], req.values[i], caching);
      }
      return;
    case Op::kAdd:
    case Op::kAppend:
    case Op::kCompareSet:
    case Op::kDelete:
      if (!req.keys.empty()) forget(req.keys[0]);
      return;
    default:
      return;
  }
}

void WorldCache::keep(const std::string& key, const std::string& value, bool caching) {
  forget(key);
  if (!caching || bytes_ + key.size() + value.size() > max_bytes_) return;
  values_.emplace(key, value);
  bytes_ += key.size() + value.size();
}

void WorldCache::forget(const std::string& key) {
  auto it = values_.find(key);
  if (it == values_.end()) return;
  bytes_ -= key.size() + it->second.size();
  values_.erase(it);
}

bool WorldCache::answer(const Request& req, std::string& out) const {
  if (req.op != Op::kWait && req.op != Op::kCheck && req.op != Op::kGet &&
      req.op != Op::kMultiGet) {
    return false;
  }
  for (const std::string& k : req.keys) {
    if (values_.find(k) == values_.end()) return false;
  }
  switch (req.op) {
    case Op::kWait:
      tcpstore::put_u8(out, tcpstore::kStopWaiting);
      break;
    case Op::kCheck:
      tcpstore::put_u8(out, tcpstore::kCheckReady);
      break;
    default:
      for (const std::string& k : req.keys) tcpstore::put_bytes(out, values_.find(k)->second);
  }
  return true;
}

void WorldCache::forget_all() {
  values_.clear();
  bytes_ = 0;
}

std::vector<std::int64_t> combined_answers(std::int64_t total,
                                           const std::vector<std::int64_t>& deltas) {
  std::uint64_t sum = 0;
  for (std::int64_t d : deltas) sum += static_cast<std::uint64_t>(d);
  std::uint64_t v = static_cast<std::uint64_t>(total) - sum;  // the value before the batch
  std::vector<std::int64_t> out;
  out.reserve(deltas.size());
  for (std::int64_t d : deltas) {
    v += static_cast<std::uint64_t>(d);
    out.push_back(static_cast<std::int64_t>(v));
  }
  return out;
}

bool WriteBehind::held(Clock::time_point now) {
  if (since_) return false;
  since_ = now;
  return true;
}

std::optional<WriteBehind::Clock::time_point> WriteBehind::due() const {
  if (!since_) return std::nullopt;
  return *since_ + (busy_seen_ ? busy_ : quiet_);
}

bool WriteBehind::fired(Clock::time_point last_query) {
  if (!since_) return false;
  if (!busy_seen_ && last_query > *since_ && quiet_ < busy_) {
    busy_seen_ = true;
    return false;
  }
  return true;
}

bool WriteBehind::overdue(Clock::time_point last_query) const {
  return since_ && last_query - *since_ >= busy_;
}

void WriteBehind::sent() {
  since_.reset();
  busy_seen_ = false;
}

}  // namespace muster::rendezvous::relay
