// The store relay: a node's ADDs of one key combined into one, and WAITs for the same keys
// riding on one (store_relay_impl.h; docs/store.md).
#include "client/store_relay_impl.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

namespace muster::rendezvous {

using namespace relay_internal;

bool StoreRelay::Impl::combines(const Local& c, const Request& req) const {
  if (!opts_.combine || !c.inflight.empty()) return false;
  if (req.op == Op::kAdd) return true;
  return req.op == Op::kWait && c.world->waits.has(req.keys);
}

void StoreRelay::Impl::join_add(const LocalPtr& c, const Request& req) {
  World& w = *c->world;
  w.cache.remember(req, caches_);  // written to the log when it goes up (a failover replays what went)
  c->held = true;
  ++n_adds_held_;
  Adder& a = w.adders[req.keys[0]];
  a.next.members.emplace_back(c, req.delta);
  a.next.sum += static_cast<std::uint64_t>(req.delta);
  if (!a.flies && !a.queued) queue_launch(w, req.keys[0]);
}

void StoreRelay::Impl::queue_launch(World& w, const std::string& key) {
  w.adders[key].queued = true;
  asio::post(io_, [this, self = shared_from_this(), round = w.round, key] {
    auto it = worlds_.find(round);
    if (it != worlds_.end()) launch(*it->second, key);
  });
}

void StoreRelay::Impl::launch(World& w, const std::string& key) {
  auto it = w.adders.find(key);
  if (it == w.adders.end()) return;
  Adder& a = it->second;
  a.queued = false;
  if (a.flies || a.next.members.empty() || up_ == nullptr) return;  // a new stream sends it
  a.flying = std::exchange(a.next, {});
  a.flies = true;
  log_write(w, add_of(key, a.flying));
  send_add(w, key, a.flying);
  ++n_combined_adds_;
  n_adds_combined_ += a.flying.members.size();
}

Request StoreRelay::Impl::add_of(const std::string& key, const AddBatch& b) {
  Request add;
  add.op = Op::kAdd;
  add.keys = {key};
  add.delta = static_cast<std::int64_t>(b.sum);
  return add;
}

void StoreRelay::Impl::send_add(World& w, const std::string& key, const AddBatch& b) {
  v1::RelayFrame f;
  std::string data;
  if (w.adds_conn == 0) {
    w.adds_conn = next_id_++;
    adds_conns_.emplace(w.adds_conn, w.round);
    f.set_round(w.round);
    data = validate_;
  }
  data += tcpstore::encode(Dialect::kTorch2, add_of(key, b));
  f.set_conn(w.adds_conn);
  f.set_data(std::move(data));
  up_->send(std::move(f));
  nothing_behind();
  w.adds_flying.push_back(key);
}

void StoreRelay::Impl::on_adds(int round, v1::RelayFrame& f) {
  auto wi = worlds_.find(round);
  if (wi == worlds_.end()) return;
  World& w = *wi->second;
  if (f.closed()) {  // the first unanswered one failed; the server served none after it
    adds_conns_.erase(w.adds_conn);
    w.adds_conn = 0;
    w.forget_all();
    std::deque<std::string> flying = std::exchange(w.adds_flying, {});
    if (flying.empty()) return;
    Adder& failed = w.adders[flying.front()];
    failed.flies = false;
    const AddBatch lost = std::exchange(failed.flying, {});
    if (!failed.next.members.empty() && !failed.queued) queue_launch(w, flying.front());
    flying.pop_front();
    // Those after it, not served, go again in their order on a new connection (their ADDs
    // are in the replay log already).
    for (const std::string& key : flying) send_add(w, key, w.adders[key].flying);
    for (const auto& [m, delta] : lost.members) {
      if (m->closed) continue;
      ++n_closed_;
      spdlog::warn("store relay: the server closed the connection from {}: {}", name_of(m->from),
                   f.error());
      drop(m, false);
    }
    return;
  }
  std::vector<LocalPtr> answered;
  for (std::size_t at = 0; at + 8 <= f.data().size() && !w.adds_flying.empty(); at += 8) {
    std::int64_t total = 0;
    std::memcpy(&total, f.data().data() + at, 8);
    const std::string key = std::move(w.adds_flying.front());
    w.adds_flying.pop_front();
    auto it = w.adders.find(key);
    if (it == w.adders.end()) continue;
    Adder& a = it->second;
    a.flies = false;
    AddBatch b = std::exchange(a.flying, {});
    std::vector<std::int64_t> deltas;
    for (const auto& [m, delta] : b.members) deltas.push_back(delta);
    const std::vector<std::int64_t> each = relay::combined_answers(total, deltas);
    for (std::size_t i = 0; i < b.members.size(); ++i) {
      const LocalPtr& m = b.members[i].first;
      if (m->closed) continue;
      tcpstore::put_i64(m->out, each[i]);
      m->held = false;
      --n_adds_held_;
      answered.push_back(m);
    }
    if (!a.next.members.empty()) {
      launch(w, key);
    } else if (!a.queued) {
      w.adders.erase(it);
    }
  }
  for (const LocalPtr& m : answered) {  // what they sent after their ADD goes on
    if (m->closed) continue;
    process(m);
    read(m);
  }
}

void StoreRelay::Impl::join_wait(const LocalPtr& c, const Request& req) {
  c->world->waits.follow(c, req.keys);
  ++n_waits_joined_;
}

void StoreRelay::Impl::answer_followers(const LocalPtr& c, const std::string* value) {
  auto ended = c->world->waits.answered(c);
  if (!ended) return;
  for (const LocalPtr& m : ended->followers) {
    if (m->closed) continue;
    tcpstore::put_u8(m->out, tcpstore::kStopWaiting);
    if (value != nullptr && ended->keys.size() == 1) m->stash.emplace(ended->keys[0], *value);
    flush(m);
  }
}

void StoreRelay::Impl::hand_on(Local& c) {
  auto next = c.world->waits.hand_on(c.shared_from_this(), c.world->closing);
  if (next) send_wait(next->leader, next->keys, true);
}

void StoreRelay::Impl::stop_leading(Local& c) {
  for (Owed& o : c.inflight) o.leads = false;
  hand_on(c);
}

void StoreRelay::Impl::ask_alone(const LocalPtr& c) {
  if (auto keys = c->world->waits.leave(c)) send_wait(c, *keys, false);
}

void StoreRelay::Impl::send_wait(const LocalPtr& c, const std::vector<std::string>& keys, bool leads) {
  Request wait;
  wait.op = Op::kWait;
  wait.keys = keys;
  std::string frame = tcpstore::encode(c->dialect, wait);
  c->inflight.push_back(Owed{Op::kWait, frame, leads});
  c->inflight_bytes += frame.size();
  ++n_waits_sent_;
  if (keys.size() == 1) c->wait_key = keys[0];
  if (up_ != nullptr) up_frame(c, std::move(frame), keys.size() == 1 ? &keys[0] : nullptr);
}

}  // namespace muster::rendezvous
