#include "store/tcpstore/table.h"

#include <iterator>

namespace muster::rendezvous::tcpstore {

void Table::serve(const ConnPtr& c, Request& r) {
  std::string& o = c->out;
  if (answers(r.op) && r.op != Op::kWait) ++c->replies;  // a WAIT's, when it is answered
  switch (r.op) {
    case Op::kValidate:
      return;
    case Op::kPing:
      return put_u32(o, r.number);
    case Op::kSet:
      wrote(*c, r.keys[0], true);
      return set(c, r.keys[0], std::move(r.values[0]), kWatchUpdated);
    case Op::kAppend: {
      wrote(*c, r.keys[0], false);
      const std::string* v = table_.find(r.keys[0]);
      std::string joined = v != nullptr ? *v + r.values[0] : std::move(r.values[0]);
      return set(c, r.keys[0], std::move(joined), kWatchAppended);
    }
    case Op::kCompareSet:
      return compare_set(c, r);
    case Op::kGet:
    case Op::kMultiGet:
      for (const auto& k : r.keys) {
        const std::string* v = table_.find(k);
        put_bytes(o, v != nullptr ? *v : std::string());
      }
      return;
    case Op::kAdd:
      return add(c, r);
    case Op::kCheck:
      return put_u8(o, present(r.keys) ? kCheckReady : kCheckNotReady);
    case Op::kWait:
      return wait(c, r.keys);
    case Op::kNumKeys:
      return put_i64(o, static_cast<std::int64_t>(table_.size()));
    case Op::kDelete:
      wrote(*c, r.keys[0], false);
      return erase(c, r.keys[0]);
    case Op::kWatchKey:
      watchers_[r.keys[0]].push_back(c);
      return put_u8(o, kWatchRegistered);
    case Op::kMultiSet:
      for (const auto& k : r.keys) wrote(*c, k, true);
      if (absl::Status s = table_.multi_set(r.keys, r.values); !s.ok()) {
        return c->fail("MULTI_SET: " + std::string(s.message()));
      }
      for (const auto& k : r.keys) wake(k, false);
      return;
    case Op::kCancelWait:
      unpark(*c);
      c->prefetch.reset();
      return put_u8(o, kWaitCanceled);
    case Op::kQueuePush:
    case Op::kQueuePop:
    case Op::kQueueLen:
      return queue(c, r);
  }
}

// The value `key` had, for a watcher's update; only copied when someone watches it.
std::string Table::old_value(const std::string& key, const std::string* before) const {
  return before != nullptr && watchers_.count(key) != 0 ? *before : std::string();
}

void Table::compare_set(const ConnPtr& c, const Request& r) {
  const std::string& key = r.keys[0];
  wrote(*c, key, false);
  const std::string &expected = r.values[0], &desired = r.values[1];
  const std::string* before = table_.find(key);
  const bool existed = before != nullptr;
  // c10d's rule (KvTable::compare_set): a missing key is set only when `expected` is empty.
  const bool changes = existed ? *before == expected && desired != expected : expected.empty();
  const std::string old = old_value(key, before);
  auto got = table_.compare_set(key, expected, desired);
  if (!got.ok()) return c->fail("COMPARE_SET: " + std::string(got.status().message()));
  put_bytes(c->out, *got);
  if (changes) {
    changed(key, existed ? kWatchUpdated : kWatchCreated, old, desired);
    wake(key, false);
  }
}

void Table::add(const ConnPtr& c, const Request& r) {
  const std::string& key = r.keys[0];
  wrote(*c, key, false);
  const std::string* before = table_.find(key);
  const bool existed = before != nullptr;
  const std::string old = old_value(key, before);
  auto sum = table_.add(key, r.delta);
  if (!sum.ok()) return c->fail("ADD: " + std::string(sum.status().message()));
  put_i64(c->out, *sum);
  wake(key, false);
  changed(key, existed ? kWatchUpdated : kWatchCreated, old, *table_.find(key));
}

void Table::erase(const ConnPtr& c, const std::string& key) {
  const std::string old = old_value(key, table_.find(key));
  const bool erased = table_.erase(key);
  put_i64(c->out, erased ? 1 : 0);
  if (erased) changed(key, kWatchDeleted, old, "");
}

// QUEUE_PUSH (no reply; wakes one waiter), QUEUE_POP (the length, then the value when there
// is one; never waits), QUEUE_LEN.
void Table::queue(const ConnPtr& c, Request& r) {
  const std::string& key = r.keys[0];
  auto it = queues_.find(key);
  const std::size_t n = it == queues_.end() ? 0 : it->second.size();
  if (r.op == Op::kQueueLen) return put_i64(c->out, static_cast<std::int64_t>(n));
  if (r.op == Op::kQueuePop) {
    put_i64(c->out, static_cast<std::int64_t>(n));
    if (n == 0) return;
    put_bytes(c->out, it->second.front());
    queue_bytes_ -= key.size() + it->second.front().size();
    it->second.pop_front();
    if (it->second.empty()) queues_.erase(it);
    return;
  }
  const std::size_t bytes = key.size() + r.values[0].size();
  if (table_.bytes() + queue_bytes_ + bytes > limits_.max_bytes) {
    return c->fail("QUEUE_PUSH: the run's store is full");
  }
  queue_bytes_ += bytes;
  queues_[key].push_back(std::move(r.values[0]));
  wake(key, true);
}

void Table::set(const ConnPtr& c, const std::string& key, std::string value, std::uint8_t kind) {
  const std::string* before = table_.find(key);
  const bool existed = before != nullptr;
  const std::string old = old_value(key, before);
  if (absl::Status s = table_.set(key, value); !s.ok()) return c->fail(std::string(s.message()));
  changed(key, existed ? kind : kWatchCreated, old, value);
  wake(key, false);
}

bool Table::present(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (table_.find(k) != nullptr) continue;
    auto q = queues_.find(k);
    if (q == queues_.end() || q->second.empty()) return false;
  }
  return true;
}

void Table::wait(const ConnPtr& c, const std::vector<std::string>& keys) {
  if (present(keys)) return stop_waiting(*c);
  if (c->awaited > 0) return c->fail("WAIT while its previous WAIT is still parked");
  if (n_waits_ >= max_waits_) {
    return c->fail("WAIT: " + std::to_string(max_waits_) + " waits are parked already");
  }
  for (const auto& k : keys) {
    if (table_.find(k) != nullptr) continue;
    auto q = queues_.find(k);
    if (q != queues_.end() && !q->second.empty()) continue;
    waiters_[k].push_back(c);
    c->wait_keys.push_back(k);
    ++c->awaited;
  }
  ++n_waits_;
}

// A WAIT answered; a relayed connection's prefetched value goes with it.
void Table::stop_waiting(Conn& c) {
  put_u8(c.out, kStopWaiting);
  ++c.replies;
  if (c.prefetch) {
    const std::string* v = table_.find(*c.prefetch);
    c.prefetched = v != nullptr ? *v : std::string();
    c.prefetch.reset();
  }
}

// `key` was written: its waiters are one key nearer (one of them only, for a queue push).
void Table::wake(const std::string& key, bool one) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  auto& list = it->second;
  while (!list.empty()) {
    ConnPtr w = list.front().lock();
    list.pop_front();
    if (!w || w->closed || w->awaited == 0) continue;
    if (--w->awaited == 0) {
      w->wait_keys.clear();
      --n_waits_;
      stop_waiting(*w);
      w->flush();
      if (one) break;
    }
  }
  if (list.empty()) waiters_.erase(it);
}

void Table::unpark(Conn& c) {
  if (c.awaited == 0) return;
  for (const auto& k : c.wait_keys) {
    auto it = waiters_.find(k);
    if (it == waiters_.end()) continue;
    auto& list = it->second;
    for (auto w = list.begin(); w != list.end();) {
      auto p = w->lock();
      w = (!p || p.get() == &c) ? list.erase(w) : std::next(w);
    }
    if (list.empty()) waiters_.erase(it);
  }
  c.wait_keys.clear();
  c.awaited = 0;
  --n_waits_;
}

void Table::wrote(const Conn& c, const std::string& key, bool keeps) {
  std::shared_ptr<KeyHolder> mine = keeps ? c.holder.lock() : nullptr;
  auto it = held_.find(key);
  if (it == held_.end()) {
    if (mine) held_.emplace(key, std::move(mine));
    return;
  }
  // The writer's own agent needs no word: it forgets a key it cannot know the value of when it
  // sends the query.
  std::shared_ptr<KeyHolder> h = it->second.lock();
  if (h && h != c.holder.lock()) h->dropped(round_, key);
  if (mine) {
    it->second = std::move(mine);
  } else {
    held_.erase(it);
  }
}

// WATCH_KEY (torch 1.13's callback connection): the change, to every watcher of `key`.
void Table::changed(const std::string& key, std::uint8_t kind, const std::string& old,
                    const std::string& now) {
  auto it = watchers_.find(key);
  if (it == watchers_.end()) return;
  for (auto w = it->second.begin(); w != it->second.end();) {
    ConnPtr p = w->lock();
    if (!p || p->closed) {
      w = it->second.erase(w);
      continue;
    }
    put_u8(p->out, kind);
    put_bytes(p->out, key);
    put_bytes(p->out, kind == kWatchCreated ? std::string() : old);
    put_bytes(p->out, now);
    p->flush();
    ++w;
  }
  if (it->second.empty()) watchers_.erase(it);
}

}  // namespace muster::rendezvous::tcpstore
