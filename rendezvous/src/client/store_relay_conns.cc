// The store relay: a worker's socket (store_relay_impl.h): frames read, answered here or sent
// up, replies written back, a connection failed or dropped.
#include "client/store_relay_impl.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

namespace muster::rendezvous {

using namespace relay_internal;

void StoreRelay::Impl::read(const LocalPtr& c) {
  if (c->closed || c->wire.reading()) return;
  // Held behind its combined ADD: read on only to see it close (what it sends meanwhile
  // waits in `in`, one chunk at most; TCP holds the rest).
  if (c->held && c->wire.in().size() >= kReadChunk) return;
  if (!ready_ || (up_ != nullptr && up_->full(opts_.max_queued_up_bytes))) {
    paused_.push_back(c);  // read on when the stream is there and takes more
    return;
  }
  c->wire.await_readable([this, self = shared_from_this(), c](const boost::system::error_code& ec) {
    if (c->closed) return;
    if (ec) return drop(c, true);
    on_readable(c);
  });
}

void StoreRelay::Impl::on_readable(const LocalPtr& c) {
  if (!ready_ || up_ == nullptr) return read(c);  // the stream went meanwhile: wait for it
  switch (c->wire.read_into(buf_)) {
    case tcpstore::Socket::Read::kWouldBlock: return read(c);
    case tcpstore::Socket::Read::kGone: return drop(c, true);
    case tcpstore::Socket::Read::kRead: break;
  }
  process(c);
  read(c);
}

void StoreRelay::Impl::process(const LocalPtr& c) {
  last_query_ = std::chrono::steady_clock::now();
  const std::string& in = c->wire.in();
  std::size_t pos = 0, sent = 0;  // [sent, pos): frames parsed, not yet handed up
  bool asks = false;              // one of them has an answer to wait for
  auto hand_up = [&](std::size_t end) {
    up_frame(c, in.substr(sent, end - sent), nullptr, !asks);
    asks = false;
  };
  Request req;
  while (!c->closed && !c->held && pos < in.size()) {
    // It sends more after its WAIT: the server may answer that first (torch's own client
    // sends nothing but CANCEL_WAIT there). One that rode on another's WAIT asks for
    // itself; one that led stops leading (another asks in its place).
    if (c->world->waits.follows(c)) ask_alone(c);
    if (c->world->waits.leads(c)) stop_leading(*c);
    const auto r = tcpstore::parse(c->dialect, in.data() + pos, in.size() - pos, frame_, req);
    if (r.what == Parsed::kNeedMore) break;
    if (r.what == Parsed::kError) return fail(c, r.error);
    const std::size_t start = pos;
    pos += r.consumed;
    if (req.op == Op::kValidate) {  // the dialect is known: it goes with the first query up
      hand_up(start);
      sent = pos;
      continue;
    }
    if (c->stash && req.op == Op::kGet && req.keys.size() == 1 &&
        req.keys[0] == c->stash->first) {
      // torch's get(): the WAIT brought the value.
      hand_up(start);
      tcpstore::put_bytes(c->out, c->stash->second);
      c->stash.reset();
      ++n_gets_here_;
      sent = pos;
      continue;
    }
    c->stash.reset();
    if (answer_here(*c, req)) {
      hand_up(start);
      ++n_reads_here_;
      sent = pos;
      continue;
    }
    if (combines(*c, req)) {
      hand_up(start);
      req.op == Op::kAdd ? join_add(c, req) : join_wait(c, req);
      sent = pos;
      continue;
    }
    if (!note(*c, req, in.data() + start, r.consumed)) {
      return fail(c, "over " + std::to_string(opts_.max_unsent_bytes) +
                         " bytes of queries unanswered");
    }
    if (req.op == Op::kWait && req.keys.size() == 1) {
      hand_up(start);
      c->wait_key = req.keys[0];
      up_frame(c, in.substr(start, r.consumed), &req.keys[0]);
      sent = pos;
      continue;
    }
    asks = asks || tcpstore::answers(req.op) || req.op == Op::kCancelWait;
  }
  if (c->closed) return;
  hand_up(pos);
  c->wire.consumed(pos);
  arm_partial(c, pos > 0);
  flush(c);
  send_behind(false);  // after the replies: the worker reads them meanwhile
}

bool StoreRelay::Impl::note(Local& c, const Request& req, const char* frame, std::size_t size) {
  World& w = *c.world;
  log_write(w, req);
  w.cache.remember(req, caches_);
  if (req.op == Op::kWatchKey) c.watching = true;
  if (req.op == Op::kCancelWait) {  // the WAIT is answered no more (the CANCEL_WAIT is)
    for (auto it = c.inflight.rbegin(); it != c.inflight.rend(); ++it) {
      if (it->op != Op::kWait) continue;
      c.inflight_bytes -= it->frame.size();
      const bool led = it->leads;
      c.inflight.erase(std::next(it).base());
      if (led) hand_on(c);
      break;
    }
    c.wait_key.reset();
  }
  if (!tcpstore::answers(req.op)) return true;
  c.inflight.push_back(Owed{req.op, std::string(frame, size)});
  c.inflight_bytes += size;
  if (req.op == Op::kWait) ++n_waits_sent_;
  // Others' WAITs for these keys may ride on it.
  if (req.op == Op::kWait && opts_.combine && w.waits.lead(c.shared_from_this(), req.keys)) {
    c.inflight.back().leads = true;
  }
  return c.inflight_bytes <= opts_.max_unsent_bytes;
}

void StoreRelay::Impl::log_write(World& w, const Request& req) {
  w.log.note(req);
  if (!w.log.complete() && !w.log_warned) {
    w.log_warned = true;
    spdlog::warn("store relay: round {}'s writes from this node passed {} bytes; they are no "
                 "longer kept to be written again after a failover",
                 w.round, opts_.limits.max_bytes);
  }
}

bool StoreRelay::Impl::answer_here(Local& c, const Request& req) {
  return caches_ && c.inflight.empty() && c.world->cache.answer(req, c.out);
}

void StoreRelay::Impl::forget_all() {
  for (auto& [round, w] : worlds_) w->forget_all();
}

void StoreRelay::Impl::up_frame(const LocalPtr& c, std::string data, const std::string* prefetch,
              bool later) {
  if (data.empty()) return;
  v1::RelayFrame f;
  f.set_conn(c->id);
  if (!c->opened) {
    f.set_round(c->world->round);
    c->opened = true;
    // Its VALIDATE stayed here (process): the server learns its dialect from it.
    if (c->dialect == Dialect::kTorch2) data.insert(0, validate_);
  }
  if (prefetch != nullptr) {
    f.set_prefetch(*prefetch);
    f.set_has_prefetch(true);
  }
  f.set_data(std::move(data));
  up_->send(std::move(f), later);
  if (!later) {
    nothing_behind();  // they went with it
  } else if (behind_.held(std::chrono::steady_clock::now())) {
    arm_behind();
  }
}

void StoreRelay::Impl::arm_behind() {
  if (behind_armed_ || !behind_.holding() || stopping_) return;
  behind_armed_ = true;
  behind_timer_.expires_at(*behind_.due());
  behind_timer_.async_wait([this, self = shared_from_this()](const boost::system::error_code& ec) {
    behind_armed_ = false;
    if (ec || !behind_.holding() || !behind_.fired(last_query_)) return arm_behind();
    send_behind(true);
  });
}

void StoreRelay::Impl::send_behind(bool due) {
  if (!behind_.holding() || up_ == nullptr) return;
  if (!due && !behind_.overdue(last_query_)) return;
  nothing_behind();
  up_->kick();
}

void StoreRelay::Impl::nothing_behind() {
  behind_.sent();
  if (behind_armed_) behind_timer_.cancel();
}

void StoreRelay::Impl::arm_partial(const LocalPtr& c, bool progressed) {
  // held: what it holds is whole frames that wait
  c->wire.arm_partial(c->wire.in().empty() || c->held, progressed, opts_.partial_frame_timeout,
                      [this, self = shared_from_this(), c] {
                        if (c->closed || c->wire.in().empty()) return;
                        fail(c, tcpstore::Socket::half_sent(opts_.partial_frame_timeout));
                      });
}

void StoreRelay::Impl::flush(const LocalPtr& c) {
  if (c->closed) return;
  const std::size_t unsent = c->wire.unsent(c->out);
  switch (c->wire.send(c->out, opts_.max_unsent_bytes,
                       [this, self = shared_from_this(), c](const boost::system::error_code& ec) {
                         if (c->closed) return;
                         if (ec) return drop(c, true);
                         flush(c);
                       })) {
    case tcpstore::Socket::Send::kOverLimit:
      return fail(c, tcpstore::Socket::unread(unsent));
    case tcpstore::Socket::Send::kBroken: return drop(c, true);
    case tcpstore::Socket::Send::kSent:
    case tcpstore::Socket::Send::kWriting: return;
  }
}

void StoreRelay::Impl::fail(const LocalPtr& c, const std::string& why) {
  if (c->closed) return;
  ++n_closed_;
  spdlog::warn("store relay: closed the connection from {}: {}", name_of(c->from), why);
  drop(c, true);
}

void StoreRelay::Impl::drop(const LocalPtr& c, bool tell) {
  if (c->closed) return;
  c->closed = true;
  if (c->held) --n_adds_held_;
  if (tell && c->opened && up_ != nullptr) {
    v1::RelayFrame f;
    f.set_conn(c->id);
    f.set_closed(true);
    up_->send(std::move(f));
  }
  if (c->world->waits.leads(c)) hand_on(*c);
  c->world->waits.leave(c);
  c->wire.close();
  c->world->conns.erase(c);
  by_id_.erase(c->id);
  --n_conns_;
}

}  // namespace muster::rendezvous
