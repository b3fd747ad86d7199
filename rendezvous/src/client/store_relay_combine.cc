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
  if (w.adds.join(req.keys[0], c, req.delta)) queue_launch(w, req.keys[0]);
}

void StoreRelay::Impl::queue_launch(World& w, const std::string& key) {
  asio::post(io_, [this, self = shared_from_this(), round = w.round, key] {
    auto it = worlds_.find(round);
    if (it != worlds_.end()) launch(*it->second, key);
  });
}

void StoreRelay::Impl::launch(World& w, const std::string& key) {
  // Without a stream the new one sends it (ensure_stream).
  const std::optional<std::int64_t> sum = w.adds.launch(key, up_ != nullptr);
  if (!sum) return;
  log_write(w, add_of(key, *sum));
  send_add(w, key, *sum);
  ++n_combined_adds_;
  n_adds_combined_ += w.adds.flying_members(key);
}

Request StoreRelay::Impl::add_of(const std::string& key, std::int64_t sum) {
  Request add;
  add.op = Op::kAdd;
  add.keys = {key};
  add.delta = sum;
  return add;
}

void StoreRelay::Impl::send_add(World& w, const std::string& key, std::int64_t sum) {
  v1::RelayFrame f;
  std::string data;
  if (w.adds_conn == 0) {
    w.adds_conn = next_id_++;
    adds_conns_.emplace(w.adds_conn, w.round);
    f.set_round(w.round);
    data = validate_;
  }
  data += tcpstore::encode(Dialect::kTorch2, add_of(key, sum));
  f.set_conn(w.adds_conn);
  f.set_data(std::move(data));
  up_->send(std::move(f));
  nothing_behind();
}

void StoreRelay::Impl::on_adds(int round, v1::RelayFrame& f) {
  auto wi = worlds_.find(round);
  if (wi == worlds_.end()) return;
  World& w = *wi->second;
  if (f.closed()) {  // the first unanswered one failed; the server served none after it
    adds_conns_.erase(w.adds_conn);
    w.adds_conn = 0;
    w.forget_all();
    auto failed = w.adds.first_failed();
    if (failed.relaunch) queue_launch(w, *failed.relaunch);
    // Those after it, not served, go again in their order on a new connection (their ADDs
    // are in the replay log already).
    for (const auto& [key, sum] : w.adds.resend()) send_add(w, key, sum);
    for (const LocalPtr& m : failed.lost) {
      if (m->closed) continue;
      ++n_closed_;
      spdlog::warn("store relay: the server closed the connection from {}: {}", name_of(m->from),
                   f.error());
      drop(m, false);
    }
    return;
  }
  std::vector<LocalPtr> answered;
  for (std::size_t at = 0; at + 8 <= f.data().size() && w.adds.flying(); at += 8) {
    std::int64_t total = 0;
    std::memcpy(&total, f.data().data() + at, 8);
    auto r = w.adds.answer(total);
    for (auto& [m, each] : r->each) {
      if (m->closed) continue;
      tcpstore::put_i64(m->out, each);
      m->held = false;
      --n_adds_held_;
      answered.push_back(std::move(m));
    }
    if (r->launch_next) launch(w, r->key);
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
