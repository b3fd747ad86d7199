#include "client/replay_log.h"

namespace muster::rendezvous::tcpstore {

void ReplayLog::note(const Request& r) {
  if (!complete_) return;
  switch (r.op) {
    case Op::kSet:
      return add(r.keys[0], Write{Op::kSet, r.values[0], {}, 0});
    case Op::kMultiSet:
      for (std::size_t i = 0; i < r.keys.size() && i < r.values.size(); ++i) {
        add(r.keys[i], Write{Op::kSet, r.values[i], {}, 0});
      }
      return;
    case Op::kAppend:
      return add(r.keys[0], Write{Op::kAppend, r.values[0], {}, 0});
    case Op::kAdd:
      return add(r.keys[0], Write{Op::kAdd, {}, {}, r.delta});
    case Op::kCompareSet:
      return add(r.keys[0], Write{Op::kCompareSet, r.values[0], r.values[1], 0});
    case Op::kDelete:
      return add(r.keys[0], Write{Op::kDelete, {}, {}, 0});
    default:
      return;
  }
}

void ReplayLog::add(const std::string& key, Write w) {
  auto [it, fresh] = keys_.try_emplace(key);
  if (fresh) bytes_ += key.size() + 64;
  std::vector<Write>& list = it->second;
  const bool merges = !list.empty() && list.back().op == w.op &&
                      (w.op == Op::kAdd || w.op == Op::kAppend);
  if (w.op == Op::kSet || w.op == Op::kDelete) {
    for (const Write& old : list) bytes_ -= old.a.size() + old.b.size() + 32;
    list.clear();
  }
  if (merges) {
    list.back().delta += w.delta;
    list.back().a += w.a;
    bytes_ += w.a.size();
  } else {
    bytes_ += w.a.size() + w.b.size() + 32;
    list.push_back(std::move(w));
  }
  if (bytes_ > max_bytes_) {
    complete_ = false;
    keys_.clear();
  }
}

std::size_t ReplayLog::writes() const {
  std::size_t n = 0;
  for (const auto& [key, list] : keys_) n += list.size();
  return n;
}

std::vector<std::string> ReplayLog::frames() const {
  std::vector<std::string> out;
  Request v;
  v.op = Op::kValidate;
  v.number = kValidationMagic;
  out.push_back(encode(Dialect::kTorch2, v));
  for (const auto& [key, list] : keys_) {
    for (const Write& w : list) {
      Request r;
      r.op = w.op;
      r.keys = {key};
      if (w.op == Op::kSet || w.op == Op::kAppend) r.values = {w.a};
      if (w.op == Op::kCompareSet) r.values = {w.a, w.b};
      r.delta = w.delta;
      out.push_back(encode(Dialect::kTorch2, r));
    }
  }
  return out;
}

}  // namespace muster::rendezvous::tcpstore
